package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/nats-consumer/consumer"
	"github.com/idemkit/idem/internal/testdb"
)

// twice is ts published twice, shuffled.
func twice(ts []consumer.Transfer) []consumer.Transfer {
	msgs := append(append([]consumer.Transfer(nil), ts...), ts...)
	rand.New(rand.NewPCG(7, 7)).Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	return msgs
}

// TestThroughPgBouncer: one consumer's pool goes through PgBouncer in
// transaction mode with pgx's default configuration (its statement cache),
// the other's straight to the server; every message published twice. Each
// transfer is booked once and every message acked.
func TestThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	var dbname string
	if err := w.pool.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	ts := transfers(60)
	w.publish(t, twice(ts)...)
	st := w.run(t, w.consumerAt(t, testdb.PgBouncer(t, dbname), 20), w.consumer(t, 20))
	if st.Applied != len(ts) || st.Poison != 0 {
		t.Errorf("stats %+v; want %d applied, no poison", st, len(ts))
	}
	w.checkBooked(t, ts)
}

// TestLeastPrivilegedRole: the consumer connects as a role that has only
// idem.grant_app and the rights on its own tables; every message published
// twice is booked once.
func TestLeastPrivilegedRole(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	role := fmt.Sprintf("nats_app_%d", rand.Int64())
	if _, err := w.pool.Exec(ctx, fmt.Sprintf(`CREATE ROLE %[1]s LOGIN; SELECT idem.grant_app('%[1]s');
		GRANT SELECT, INSERT, UPDATE ON ledger, balances TO %[1]s`, role)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = w.pool.Exec(context.Background(), fmt.Sprintf(`DROP OWNED BY %[1]s; DROP ROLE %[1]s`, role))
	})
	ts := transfers(30)
	w.publish(t, twice(ts)...)
	st := w.run(t, w.consumerAt(t, testdb.AsUser(w.dbURL, role), 25))
	if st.Applied != len(ts) || st.Poison != 0 {
		t.Errorf("stats %+v; want %d applied, no poison", st, len(ts))
	}
	w.checkBooked(t, ts)
}

// TestShutdownMidBatch: the consumer's context is cancelled (a shutdown)
// while its batch's transaction is half-way. The transaction rolls back,
// nothing is acked and the messages are put back; another consumer books
// every transfer, once.
func TestShutdownMidBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: time.Second})
	ts := transfers(10)
	w.publish(t, ts...)
	release := holdLedger(t, w)

	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, err := w.consumer(t, 10).Next(runCtx)
		done <- err
	}()
	waitForHold(t, w)
	cancel()
	if err := <-done; err == nil {
		t.Fatal("the cancelled batch returned no error")
	}
	var booked int
	if err := w.pool.QueryRow(ctx, `SELECT count(*) FROM ledger`).Scan(&booked); err != nil {
		t.Fatal(err)
	}
	info, err := w.cons.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if booked != 0 || info.AckFloor.Stream != 0 {
		t.Fatalf("after the cancelled batch: %d ledger rows, ack floor %d; want nothing booked or acked", booked, info.AckFloor.Stream)
	}
	release()
	st := w.run(t, w.consumer(t, 10))
	if st.Applied != len(ts) {
		t.Errorf("stats %+v; want the %d transfers applied by the next consumer", st, len(ts))
	}
	w.checkBooked(t, ts)
}

// TestBatchSizeOutOfRange: a BatchSize over idem.MaxBatch, or negative, and
// more messages than that given to Handle are refused with ErrBatchSize
// before anything is fetched or claimed.
func TestBatchSizeOutOfRange(t *testing.T) {
	t.Parallel()
	for _, n := range []int{-1, idem.MaxBatch + 1} {
		c := &consumer.Consumer{BatchSize: n}
		if _, err := c.Next(context.Background()); !errors.Is(err, consumer.ErrBatchSize) {
			t.Errorf("BatchSize %d: %v, want ErrBatchSize", n, err)
		}
	}
	c := &consumer.Consumer{}
	if _, err := c.Handle(context.Background(), make([]jetstream.Msg, idem.MaxBatch+1)); !errors.Is(err, consumer.ErrBatchSize) {
		t.Errorf("Handle of %d messages: %v, want ErrBatchSize", idem.MaxBatch+1, err)
	}
}
