package consumer_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/nats-consumer/consumer"
	"github.com/idemkit/idem/internal/testdb"
)

const childEnv = "NATS_CONSUMER_TEST_CHILD"

// child is the consumer as a process of its own. With CHILD_HANG set, it
// prints "committed" after its first batch's transaction commits and
// hangs there, before acking, for the test to kill it; otherwise it
// prints each batch's stats as a JSON line.
func child() int {
	ctx := context.Background()
	fail := func(err error) int { fmt.Fprintln(os.Stderr, err); return 1 }
	pool, err := pgxpool.New(ctx, os.Getenv("CHILD_DATABASE_URL"))
	if err != nil {
		return fail(err)
	}
	ic, err := idem.New(pool, nil)
	if err != nil {
		return fail(err)
	}
	nc, err := nats.Connect(os.Getenv("CHILD_NATS_URL"))
	if err != nil {
		return fail(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	cons, err := js.Consumer(ctx, streamName, durable)
	if err != nil {
		return fail(err)
	}
	c := &consumer.Consumer{JS: cons, Pool: pool, Idem: ic, BatchSize: 100, MaxWait: 200 * time.Millisecond}
	hang := os.Getenv("CHILD_HANG") != ""
	if hang {
		c.AfterCommit = func() {
			fmt.Println("committed")
			select {}
		}
	}
	fmt.Println("ready")
	enc := json.NewEncoder(os.Stdout)
	for {
		st, err := c.Next(ctx)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
		}
		if st.Fetched > 0 {
			_ = enc.Encode(st)
		}
	}
}

// proc is a running child.
type proc struct {
	cmd    *exec.Cmd
	lines  chan string
	stderr *testdb.Buffer
	once   sync.Once
}

func startChild(t *testing.T, w *world, hang bool) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_DATABASE_URL="+w.dbURL, "CHILD_NATS_URL="+w.nats.URL)
	if hang {
		cmd.Env = append(cmd.Env, "CHILD_HANG=1")
	}
	p := &proc{cmd: cmd, lines: make(chan string, 100), stderr: &testdb.Buffer{}}
	cmd.Stderr = p.stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			p.lines <- sc.Text()
		}
		close(p.lines)
		_, _ = io.Copy(io.Discard, out)
	}()
	if line := p.next(t); line != "ready" {
		t.Fatalf("child said %q, want ready\n%s", line, p.stderr)
	}
	return p
}

// next is the child's next line of output.
func (p *proc) next(t *testing.T) string {
	t.Helper()
	select {
	case line, ok := <-p.lines:
		if !ok {
			t.Fatalf("the child exited:\n%s", p.stderr)
		}
		return line
	case <-time.After(60 * time.Second):
		t.Fatalf("the child said nothing for a minute:\n%s", p.stderr)
	}
	return ""
}

// kill sends SIGKILL and reaps the process.
func (p *proc) kill() {
	p.once.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		_ = p.cmd.Wait()
	})
}

// TestKilledBetweenCommitAndAck: the consumer's process is killed with
// SIGKILL after its batch's transaction committed and before any message
// was acked. The transfers are booked and the messages still pending;
// once AckWait expires they are delivered to a new process, which finds
// every key completed and acks them all without booking again.
func TestKilledBetweenCommitAndAck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: 2 * time.Second})
	ts := transfers(20)
	w.publish(t, ts...)

	p := startChild(t, w, true)
	if line := p.next(t); line != "committed" {
		t.Fatalf("child said %q, want committed", line)
	}
	p.kill()
	w.checkBooked(t, ts)
	info, err := w.cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != len(ts) || info.AckFloor.Stream != 0 {
		t.Fatalf("after the kill: %d messages delivered and not acked (want %d), ack floor %d (want 0)",
			info.NumAckPending, len(ts), info.AckFloor.Stream)
	}

	q := startChild(t, w, false)
	var total consumer.Stats
	for total.Duplicates < len(ts) {
		var st consumer.Stats
		line := q.next(t)
		if err := json.Unmarshal([]byte(line), &st); err != nil {
			t.Fatalf("child said %q: %v", line, err)
		}
		total = sum(total, st)
		if total.Applied != 0 || total.Poison != 0 {
			t.Fatalf("the restarted consumer: %+v; want every message answered as a duplicate\n%s", total, q.stderr)
		}
	}
	w.waitSettled(t)
	q.kill()
	w.checkBooked(t, ts)
	if total.Duplicates != len(ts) {
		t.Errorf("restarted consumer: %+v", total)
	}
}
