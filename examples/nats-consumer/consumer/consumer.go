// Package consumer is a NATS JetStream consumer built on idem: it fetches a
// batch from a pull consumer, claims the batch's keys and writes the
// acquired messages' effects in one transaction, and acks once that
// transaction has committed. A message delivered again (redelivered after
// AckWait, published twice, fetched by another consumer) finds its key
// completed and is acked without its effect being written again.
package consumer

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
)

// Transfer is a message: credit Cents to Account, once per ID.
type Transfer struct {
	// ID is the producer's id for the transfer, the same on every copy it
	// publishes: the idempotency key.
	ID      string `json:"id"`
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
}

// Schema holds the tables the effect writes: a ledger row per transfer
// and the account's balance. Neither has a uniqueness constraint on the
// transfer's id: idem alone keeps a transfer from being booked twice.
const Schema = `
CREATE TABLE IF NOT EXISTS ledger (
	transfer_id text NOT NULL,
	account     text NOT NULL,
	cents       bigint NOT NULL CHECK (cents > 0),
	booked_at   timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS balances (
	account text PRIMARY KEY,
	cents   bigint NOT NULL
)`

// Setup creates the example's tables.
func Setup(ctx context.Context, pool *pgxpool.Pool) error {
	_, err := pool.Exec(ctx, Schema)
	return err
}

// ErrBatchSize: BatchSize negative or over idem.MaxBatch (what one batch
// claim takes), or more messages than that given to Handle.
var ErrBatchSize = errors.New("nats-consumer: batch size out of range")

// Consumer consumes one JetStream consumer (durable, pull, explicit acks).
type Consumer struct {
	JS   jetstream.Consumer
	Pool *pgxpool.Pool
	Idem *idem.Client
	// Source is the idem source of the keys. Default: "nats".
	Source string
	// BatchSize is how many messages one fetch asks for, at most
	// idem.MaxBatch. Default: 100.
	BatchSize int
	// MaxWait bounds how long one fetch waits for a full batch.
	// Default: 1 second.
	MaxWait time.Duration
	// RetryDelay is how long a message that could not be done now waits
	// before it is delivered again. Default: 1 second.
	RetryDelay time.Duration
	// Logger: default slog.Default().
	Logger *slog.Logger
	// AfterCommit, when set, runs after a batch's transaction committed and
	// before its messages are acked (the tests kill the process there).
	AfterCommit func()
}

// Stats says what became of one batch's messages.
type Stats struct {
	Fetched    int // messages in the batch
	Applied    int // their effect written by this batch, then acked
	Duplicates int // done before: acked without writing anything
	Retried    int // nak'd, to be delivered again after RetryDelay
	Poison     int // terminated: never delivered again
}

func (s *Stats) add(o Stats) {
	s.Fetched += o.Fetched
	s.Applied += o.Applied
	s.Duplicates += o.Duplicates
	s.Retried += o.Retried
	s.Poison += o.Poison
}

func (c *Consumer) source() string {
	if c.Source == "" {
		return "nats"
	}
	return c.Source
}

func (c *Consumer) logger() *slog.Logger {
	if c.Logger == nil {
		return slog.Default()
	}
	return c.Logger
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// Run consumes batches until ctx is done.
func (c *Consumer) Run(ctx context.Context) error {
	for ctx.Err() == nil {
		if _, err := c.Next(ctx); err != nil && ctx.Err() == nil {
			c.logger().LogAttrs(ctx, slog.LevelWarn, "nats-consumer: batch incomplete; its messages not acked are delivered again",
				slog.Any("error", err))
			select {
			case <-ctx.Done():
			case <-time.After(orDefault(c.RetryDelay, time.Second)):
			}
		}
	}
	return ctx.Err()
}

// Next fetches one batch (waiting up to MaxWait for it to fill) and
// handles it.
func (c *Consumer) Next(ctx context.Context) (Stats, error) {
	size := orDefault(c.BatchSize, 100)
	if size < 0 || size > idem.MaxBatch {
		return Stats{}, fmt.Errorf("%w: BatchSize %d, want 1 to %d", ErrBatchSize, size, idem.MaxBatch)
	}
	batch, err := c.JS.Fetch(size, jetstream.FetchMaxWait(orDefault(c.MaxWait, time.Second)))
	if err != nil {
		return Stats{}, err
	}
	var msgs []jetstream.Msg
	for m := range batch.Messages() {
		msgs = append(msgs, m)
	}
	st, herr := c.Handle(ctx, msgs)
	if err := batch.Error(); err != nil && !errors.Is(err, jetstream.ErrNoMessages) {
		herr = errors.Join(herr, err)
	}
	return st, herr
}

// item is a decoded message, with the copies of it that came in the same
// batch (the same id and body).
type item struct {
	msg    jetstream.Msg
	t      Transfer
	copies []jetstream.Msg
}

// all is the item's message and its copies.
func (it item) all() []jetstream.Msg { return append([]jetstream.Msg{it.msg}, it.copies...) }

// Handle claims, applies and acks one batch of messages (at most
// idem.MaxBatch).
func (c *Consumer) Handle(ctx context.Context, msgs []jetstream.Msg) (Stats, error) {
	if len(msgs) > idem.MaxBatch {
		return Stats{}, fmt.Errorf("%w: %d messages, at most %d", ErrBatchSize, len(msgs), idem.MaxBatch)
	}
	items, st := c.decode(ctx, msgs)
	out, err := c.apply(ctx, items)
	if err != nil {
		// One message's effect failed and rolled the batch back: apply
		// each message alone, so that one message cannot hold up the rest.
		c.logger().LogAttrs(ctx, slog.LevelWarn, "nats-consumer: batch rolled back; applying its messages one by one",
			slog.Int("messages", len(items)), slog.Any("error", err))
		return c.applyEach(ctx, items, st)
	}
	st.add(c.settle(ctx, out))
	return st, nil
}

// decode turns the messages into transfers; what is not one is poison.
func (c *Consumer) decode(ctx context.Context, msgs []jetstream.Msg) ([]item, Stats) {
	st := Stats{Fetched: len(msgs)}
	items := make([]item, 0, len(msgs))
	seen := make(map[string]int, len(msgs)) // id -> position in items
	for _, m := range msgs {
		var t Transfer
		if err := json.Unmarshal(m.Data(), &t); err != nil || strings.TrimSpace(t.ID) == "" {
			c.poison(ctx, m, fmt.Errorf("not a transfer with an id: %v", err))
			st.Poison++
			continue
		}
		if i, ok := seen[t.ID]; ok {
			if bytes.Equal(items[i].msg.Data(), m.Data()) {
				items[i].copies = append(items[i].copies, m) // settled with the first
				continue
			}
			// Another body under the same id: its next delivery is
			// claimed against the committed key and answers Mismatch.
			_ = m.NakWithDelay(orDefault(c.RetryDelay, time.Second))
			st.Retried++
			continue
		}
		seen[t.ID] = len(items)
		items = append(items, item{msg: m, t: t})
	}
	return items, st
}

// applyEach applies each item in a transaction of its own. An item that
// fails is delivered again after RetryDelay, or terminated when idem
// refuses its key or it has been delivered MaxDeliver times.
func (c *Consumer) applyEach(ctx context.Context, items []item, st Stats) (Stats, error) {
	var errs []error
	for _, it := range items {
		o, err := c.apply(ctx, []item{it})
		if err == nil {
			st.add(c.settle(ctx, o))
			continue
		}
		errs = append(errs, err)
		for _, m := range it.all() {
			if c.lastDelivery(m) || errors.Is(err, idem.ErrInvalidInput) {
				c.poison(ctx, m, err)
				st.Poison++
			} else {
				_ = m.NakWithDelay(orDefault(c.RetryDelay, time.Second))
				st.Retried++
			}
		}
	}
	return st, errors.Join(errs...)
}

// outcome is what one committed transaction decided for its messages.
type outcome struct {
	applied, duplicates, retry, poison []item
}

// apply claims the items' keys in one call and writes the acquired items'
// effects in one statement, in one transaction.
func (c *Consumer) apply(ctx context.Context, items []item) (outcome, error) {
	batch := make([]idem.BatchItem, len(items))
	transfers := make(map[string]Transfer, len(items))
	for i, it := range items {
		// The body's fingerprint: an id reused for another body answers
		// ErrMismatch instead of passing for a duplicate.
		batch[i] = idem.BatchItem{Key: it.t.ID, Fingerprint: idem.Fingerprint(it.msg.Data())}
		transfers[it.t.ID] = it.t
	}
	var o outcome
	err := pgx.BeginFunc(ctx, c.Pool, func(tx pgx.Tx) error {
		o = outcome{}
		res, err := c.Idem.WithTx(tx).DoBatch(ctx, c.source(), batch,
			func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
				ts := make([]Transfer, len(acquired))
				for i, cl := range acquired {
					ts[i] = transfers[cl.Key]
				}
				return make([]idem.WorkResult, len(acquired)), credit(ctx, tx, ts)
			})
		if err != nil {
			return err
		}
		for i, r := range res {
			switch {
			case r.Err == nil && r.Replayed:
				o.duplicates = append(o.duplicates, items[i])
			case r.Err == nil:
				o.applied = append(o.applied, items[i])
			case errors.Is(r.Err, idem.ErrInProgress):
				// Another consumer's transaction still holds the key.
				o.retry = append(o.retry, items[i])
			case errors.Is(r.Err, idem.ErrMismatch), errors.Is(r.Err, idem.ErrFailed):
				// The id was used before for another body, or failed for good.
				o.poison = append(o.poison, items[i])
			default:
				return r.Err
			}
		}
		return nil
	})
	return o, err
}

// credit is the effect of a batch of transfers, in one statement: a ledger
// row each and the accounts' balances moved by their sums (relative, so
// writing a transfer twice would show). The balances are locked in account
// order, so that concurrent batches cannot deadlock on them.
func credit(ctx context.Context, tx pgx.Tx, ts []Transfer) error {
	ids, accounts, cents := make([]string, len(ts)), make([]string, len(ts)), make([]int64, len(ts))
	for i, t := range ts {
		ids[i], accounts[i], cents[i] = t.ID, t.Account, t.Cents
	}
	_, err := tx.Exec(ctx, `
		WITH t AS (SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS t (id, account, cents)),
		     l AS (INSERT INTO ledger (transfer_id, account, cents) SELECT id, account, cents FROM t)
		INSERT INTO balances (account, cents)
		SELECT account, sum(cents) FROM t GROUP BY account ORDER BY account
		ON CONFLICT (account) DO UPDATE SET cents = balances.cents + EXCLUDED.cents`,
		ids, accounts, cents)
	return err
}

// settle acks what the committed transaction decided: the acks go out only
// now, so a crash before them leaves the messages to be delivered again,
// and the next delivery finds their keys completed.
func (c *Consumer) settle(ctx context.Context, o outcome) Stats {
	if c.AfterCommit != nil {
		c.AfterCommit()
	}
	var st Stats
	for _, it := range o.applied {
		_ = it.msg.Ack()
		st.Applied++
		st.Duplicates += ack(it.copies)
	}
	for _, it := range o.duplicates {
		st.Duplicates += ack(it.all())
	}
	for _, it := range o.retry {
		for _, m := range it.all() {
			_ = m.NakWithDelay(orDefault(c.RetryDelay, time.Second))
			st.Retried++
		}
	}
	for _, it := range o.poison {
		for _, m := range it.all() {
			c.poison(ctx, m, errors.New("the id was used for another body, or failed for good"))
			st.Poison++
		}
	}
	return st
}

// ack acks msgs and counts them.
func ack(msgs []jetstream.Msg) int {
	for _, m := range msgs {
		_ = m.Ack()
	}
	return len(msgs)
}

// lastDelivery: the consumer's MaxDeliver will not deliver m again.
func (c *Consumer) lastDelivery(m jetstream.Msg) bool {
	meta, err := m.Metadata()
	if err != nil {
		return false
	}
	max := c.JS.CachedInfo().Config.MaxDeliver
	return max > 0 && meta.NumDelivered >= uint64(max)
}

// poison terminates m: JetStream never delivers it again. The log line
// (and JetStream's MSG_TERMINATED advisory) is where an operator finds it.
func (c *Consumer) poison(ctx context.Context, m jetstream.Msg, why error) {
	c.logger().LogAttrs(ctx, slog.LevelError, "nats-consumer: message terminated",
		slog.String("subject", m.Subject()), slog.Int("bytes", len(m.Data())), slog.Any("error", why))
	_ = m.Term()
}
