package consumer_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/examples/nats-consumer/consumer"
)

// TestRedeliveredMidBatch: a batch's work is slow (its transaction waits
// on a lock the test holds, half-way through the batch) and its AckWait
// expires, so JetStream delivers the whole batch again to another fetch.
// That second consumer waits for the first transaction's keys, finds them
// completed once it commits, and acks without booking; the first acks
// after its commit. Every transfer is booked once and every message acked.
func TestRedeliveredMidBatch(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: time.Second})
	ts := transfers(10)
	w.publish(t, ts...)

	// The ledger insert of t-0005 waits for the test's lock.
	release := holdLedger(t, w)

	a, b := w.consumer(t, 10), w.consumer(t, 10)
	type result struct {
		st  consumer.Stats
		err error
	}
	first := make(chan result, 1)
	go func() {
		st, err := a.Next(ctx)
		first <- result{st, err}
	}()
	// The first batch is mid-way: its transaction holds the batch's keys
	// and waits in its effect (the ledger row of t-0005).
	waitForHold(t, w)

	// AckWait expires: the same messages are delivered to another fetch.
	batch, err := b.JS.Fetch(10, jetstream.FetchMaxWait(30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var again []jetstream.Msg
	for m := range batch.Messages() {
		meta, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		if meta.NumDelivered < 2 {
			t.Errorf("message %d delivered %d times; want a redelivery", meta.Sequence.Stream, meta.NumDelivered)
		}
		again = append(again, m)
	}
	if len(again) != 10 {
		t.Fatalf("redelivered %d messages, want the batch's 10 (%v)", len(again), batch.Error())
	}

	second := make(chan result, 1)
	go func() {
		st, err := b.Handle(ctx, again)
		second <- result{st, err}
	}()
	// The slow work goes on and commits.
	release()
	ra, rb := <-first, <-second
	if ra.err != nil || rb.err != nil {
		t.Fatalf("first batch: %v; redelivered batch: %v", ra.err, rb.err)
	}
	if ra.st.Applied != 10 {
		t.Errorf("the first batch applied %d transfers, want its 10: %+v", ra.st.Applied, ra.st)
	}
	if rb.st.Applied != 0 || rb.st.Duplicates+rb.st.Retried != 10 {
		t.Errorf("the redelivered batch: %+v; want its 10 answered as duplicates (or retried) and none applied", rb.st)
	}
	// Whatever is left (a retried message, a redelivery of the first
	// batch's acks' race) drains.
	rest := w.run(t, w.consumer(t, 10))
	if rest.Applied != 0 {
		t.Errorf("after the batch committed, %d transfers were applied again", rest.Applied)
	}
	w.checkBooked(t, ts)
}

// TestTwoConsumersEveryMessageTwice: every transfer is published twice
// (two stream messages, shuffled) and two consumers, each with its own
// NATS connection and database pool, take batches of the same durable
// consumer at once. Each transfer is applied exactly once, every message
// is acked, and nothing is left pending.
func TestTwoConsumersEveryMessageTwice(t *testing.T) {
	t.Parallel()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	ts := transfers(150)
	msgs := append(append([]consumer.Transfer(nil), ts...), ts...)
	rand.New(rand.NewPCG(40, 40)).Shuffle(len(msgs), func(i, j int) { msgs[i], msgs[j] = msgs[j], msgs[i] })
	w.publish(t, msgs...)

	st := w.run(t, w.consumer(t, 25), w.consumer(t, 25))
	if st.Applied != len(ts) {
		t.Errorf("applied %d transfers, want %d: %+v", st.Applied, len(ts), st)
	}
	if st.Applied+st.Duplicates < len(msgs) || st.Poison != 0 {
		t.Errorf("stats %+v: want every one of the %d messages acked as applied or duplicate", st, len(msgs))
	}
	info := w.waitSettled(t)
	if info.AckFloor.Stream != uint64(len(msgs)) {
		t.Errorf("ack floor at stream sequence %d, want %d", info.AckFloor.Stream, len(msgs))
	}
	w.checkBooked(t, ts)
}

// TestPoisonMessages: messages that can never be booked do not hold up
// the batch they came in, and are terminated (never delivered again):
// not JSON, an id over idem's 512 bytes (the batch's transaction fails
// and its messages are applied one by one), an id with a NUL character,
// an id reused for another body (Mismatch), and a transfer whose effect
// fails every time (a CHECK violation: nak'd until MaxDeliver, then
// terminated). The good transfers around them are booked once.
func TestPoisonMessages(t *testing.T) {
	t.Parallel()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: 30 * time.Second, MaxDeliver: 2})
	ts := transfers(6)
	w.publish(t, ts[:3]...)
	w.publishRaw(t, []byte("not json"))
	w.publish(t, consumer.Transfer{ID: strings.Repeat("k", 600), Account: "a", Cents: 1})
	w.publish(t, consumer.Transfer{ID: "nul\x00id", Account: "a", Cents: 1})
	w.publish(t, consumer.Transfer{ID: "negative", Account: "a", Cents: -5})
	w.publish(t, ts[3:]...)
	w.publish(t, consumer.Transfer{ID: ts[0].ID, Account: "thief", Cents: 1_000_000})

	st := w.run(t, w.consumer(t, 20))
	if st.Poison != 5 {
		t.Errorf("%d messages terminated, want 5: %+v", st.Poison, st)
	}
	if st.Applied != len(ts) {
		t.Errorf("applied %d transfers, want %d: %+v", st.Applied, len(ts), st)
	}
	w.checkBooked(t, ts)
}

// TestCopiesInOneBatch: copies of a message (the same id and body) in one
// batch are settled with the first: one application, the copies acked as
// duplicates, none put back for a retry.
func TestCopiesInOneBatch(t *testing.T) {
	t.Parallel()
	w := newWorld(t, jetstream.ConsumerConfig{AckWait: 30 * time.Second})
	ts := transfers(2)
	w.publish(t, ts[0], ts[0], ts[1], ts[0])
	st := w.run(t, w.consumer(t, 10))
	if st.Applied != 2 || st.Duplicates != 2 || st.Retried != 0 || st.Poison != 0 {
		t.Errorf("stats %+v; want 2 applied, 2 duplicates, nothing retried", st)
	}
	w.checkBooked(t, ts)
}

// waitFor polls cond until it holds, failing the test past a generous
// bound.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
