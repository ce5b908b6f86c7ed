package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/examples/nats-consumer/consumer"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/internal/testnats"
)

func TestMain(m *testing.M) {
	if os.Getenv("NATS_CONSUMER_RUN_MAIN") != "" {
		main()
		os.Exit(0)
	}
	testdb.Main(m)
}

// TestProgram runs the command as users would (its own process, env
// vars, a fresh database and a bare nats-server): it migrates, creates
// the stream and consumer, books every transfer published twice once, and
// exits 0 on SIGTERM.
func TestProgram(t *testing.T) {
	ctx := context.Background()
	dbURL, srv := testdb.NewEmpty(t), testnats.Start(t)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "NATS_CONSUMER_RUN_MAIN=1", "DATABASE_URL="+dbURL, "NATS_URL="+srv.URL)
	out := &testdb.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })

	nc, err := nats.Connect(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	var cons jetstream.Consumer
	waitFor(t, out, "the stream and consumer", func() bool {
		cons, err = js.Consumer(ctx, "TRANSFERS", "ledger")
		return err == nil
	})
	const n = 20
	for round := 0; round < 2; round++ {
		for i := range n {
			b, _ := json.Marshal(consumer.Transfer{ID: fmt.Sprintf("t-%d", i), Account: "acct", Cents: 10})
			if _, err := js.Publish(ctx, "transfers.new", b); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor(t, out, "every message acked", func() bool {
		info, err := cons.Info(ctx)
		return err == nil && info.NumPending == 0 && info.NumAckPending == 0 && info.AckFloor.Stream == 2*n
	})
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var rows, distinct, balance int64
	if err := pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT transfer_id), (SELECT cents FROM balances WHERE account = 'acct') FROM ledger`).
		Scan(&rows, &distinct, &balance); err != nil {
		t.Fatal(err)
	}
	if rows != n || distinct != n || balance != 10*n {
		t.Errorf("%d ledger rows for %d transfers, balance %d; want %d, %d, %d", rows, distinct, balance, n, n, 10*n)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit on SIGTERM: %v\n%s", err, out)
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("still running a minute after SIGTERM\n%s", out)
	}
}

func waitFor(t *testing.T, out *testdb.Buffer, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s\n%s", what, out)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
