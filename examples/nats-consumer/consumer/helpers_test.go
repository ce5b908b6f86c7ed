package consumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sync"
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
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	testdb.Main(m)
}

const (
	streamName = "TRANSFERS"
	durable    = "ledger"
)

// world is a real PostgreSQL database with idem and the example's tables,
// and a real nats-server with the stream and its durable pull consumer.
type world struct {
	dbURL string
	pool  *pgxpool.Pool
	nats  *testnats.Server
	js    jetstream.JetStream
	cons  jetstream.Consumer
}

func newWorld(t *testing.T, cfg jetstream.ConsumerConfig) *world {
	t.Helper()
	ctx := context.Background()
	w := &world{dbURL: testdb.New(t), nats: testnats.Start(t)}
	w.pool = testdb.Pool(t, w.dbURL, 8)
	if err := consumer.Setup(ctx, w.pool); err != nil {
		t.Fatal(err)
	}
	w.js = w.jetStream(t)
	stream, err := w.js.CreateStream(ctx, jetstream.StreamConfig{Name: streamName, Subjects: []string{"transfers.>"}})
	if err != nil {
		t.Fatalf("create stream: %v\n%s", err, w.nats.Log())
	}
	cfg.Durable = durable
	cfg.AckPolicy = jetstream.AckExplicitPolicy
	if w.cons, err = stream.CreateConsumer(ctx, cfg); err != nil {
		t.Fatalf("create consumer: %v\n%s", err, w.nats.Log())
	}
	return w
}

// jetStream is a connection of its own to the server.
func (w *world) jetStream(t *testing.T) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(w.nats.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// consumer is a Consumer with a NATS connection and a pool of its own, as
// another process would have.
func (w *world) consumer(t *testing.T, batch int) *consumer.Consumer {
	t.Helper()
	return w.consumerAt(t, w.dbURL, batch)
}

// consumerAt is consumer with its pool on dbURL (another role, PgBouncer).
func (w *world) consumerAt(t *testing.T, dbURL string, batch int) *consumer.Consumer {
	t.Helper()
	cons, err := w.jetStream(t).Consumer(context.Background(), streamName, durable)
	if err != nil {
		t.Fatal(err)
	}
	pool := testdb.Pool(t, dbURL, 4)
	return &consumer.Consumer{JS: cons, Pool: pool, Idem: testdb.Client(t, pool, nil),
		BatchSize: batch, MaxWait: 200 * time.Millisecond, RetryDelay: 100 * time.Millisecond}
}

func transfers(n int) []consumer.Transfer {
	ts := make([]consumer.Transfer, n)
	for i := range ts {
		ts[i] = consumer.Transfer{ID: fmt.Sprintf("t-%04d", i), Account: fmt.Sprintf("acct-%d", i%7), Cents: int64(100 + i)}
	}
	return ts
}

// publish publishes each transfer (waiting for the stream's ack).
func (w *world) publish(t *testing.T, ts ...consumer.Transfer) {
	t.Helper()
	for _, tr := range ts {
		b, err := json.Marshal(tr)
		if err != nil {
			t.Fatal(err)
		}
		w.publishRaw(t, b)
	}
}

func (w *world) publishRaw(t *testing.T, b []byte) {
	t.Helper()
	if _, err := w.js.Publish(context.Background(), "transfers.new", b); err != nil {
		t.Fatal(err)
	}
}

// waitSettled waits until the consumer has nothing left to deliver and
// nothing delivered unacked (NumPending and NumAckPending both 0), and
// fails the test past a generous bound.
func (w *world) waitSettled(t *testing.T) *jetstream.ConsumerInfo {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		info, err := w.cons.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 {
			return info
		}
		if time.Now().After(deadline) {
			t.Fatalf("the consumer did not settle: %d pending, %d delivered and not acked", info.NumPending, info.NumAckPending)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// run runs cs until the consumer has settled, and returns their stats.
func (w *world) run(t *testing.T, cs ...*consumer.Consumer) consumer.Stats {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stats := make(chan consumer.Stats, len(cs))
	for _, c := range cs {
		go func() {
			var total consumer.Stats
			for ctx.Err() == nil {
				st, _ := c.Next(ctx)
				total = sum(total, st)
			}
			stats <- total
		}()
	}
	w.waitSettled(t)
	cancel()
	var total consumer.Stats
	for range cs {
		total = sum(total, <-stats)
	}
	return total
}

func sum(a, b consumer.Stats) consumer.Stats {
	return consumer.Stats{Fetched: a.Fetched + b.Fetched, Applied: a.Applied + b.Applied,
		Duplicates: a.Duplicates + b.Duplicates, Retried: a.Retried + b.Retried, Poison: a.Poison + b.Poison}
}

// checkBooked: every transfer of ts has exactly one ledger row, nothing
// else was booked, and each balance is the sum of its transfers.
func (w *world) checkBooked(t *testing.T, ts []consumer.Transfer) {
	t.Helper()
	ctx := context.Background()
	rows, err := w.pool.Query(ctx, `SELECT transfer_id, count(*) FROM ledger GROUP BY transfer_id`)
	if err != nil {
		t.Fatal(err)
	}
	booked := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		booked[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := map[string]int64{}
	for _, tr := range ts {
		if booked[tr.ID] != 1 {
			t.Errorf("transfer %s booked %d times, want once", tr.ID, booked[tr.ID])
		}
		delete(booked, tr.ID)
		want[tr.Account] += tr.Cents
	}
	if len(booked) != 0 {
		t.Errorf("booked transfers that were not sent (or are poison): %v", booked)
	}
	for acct, cents := range want {
		var got int64
		if err := w.pool.QueryRow(ctx, `SELECT cents FROM balances WHERE account = $1`, acct).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != cents {
			t.Errorf("balance of %s is %d, want %d", acct, got, cents)
		}
	}
}

// holdLedger makes the ledger insert of transfer t-0005 (and so a batch
// holding it) wait for a lock the test holds until release is called.
func holdLedger(t *testing.T, w *world) (release func()) {
	t.Helper()
	ctx := context.Background()
	if _, err := w.pool.Exec(ctx, `
		CREATE FUNCTION hold() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.transfer_id = 't-0005' THEN PERFORM pg_advisory_xact_lock_shared(4242); END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER ledger_hold BEFORE INSERT ON ledger FOR EACH ROW EXECUTE FUNCTION hold()`); err != nil {
		t.Fatal(err)
	}
	conn, err := w.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(4242)`); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			if _, err := conn.Exec(ctx, `SELECT pg_advisory_unlock(4242)`); err != nil {
				t.Error(err)
			}
			conn.Release()
		})
	}
	t.Cleanup(release)
	return release
}

// waitForHold waits until a transaction waits for holdLedger's lock.
func waitForHold(t *testing.T, w *world) {
	t.Helper()
	waitFor(t, "a batch to block in its effect", func() bool {
		var waiting bool
		err := w.pool.QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND objid = 4242 AND NOT granted)`).Scan(&waiting)
		return err == nil && waiting
	})
}
