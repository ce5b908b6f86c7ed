// Package consumer is a NATS JetStream consumer built on idem: it fetches a
// batch from a pull consumer, claims the batch's keys and writes the
// acquired messages' effects in one transaction, and acks once that
// transaction has committed. A message delivered again (redelivered after
// AckWait, published twice, fetched by another consumer) finds its key
// completed and is acked without its effect being written again.
package consumer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
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

// Consumer consumes one JetStream consumer (durable, pull, explicit acks).
type Consumer struct {
	JS   jetstream.Consumer
	Pool *pgxpool.Pool
	Idem *idem.Client
	// Source is the idem source of the keys. Default: "nats".
	Source string
	// BatchSize is how many messages one fetch asks for. Default: 100.
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
			c.logger().LogAttrs(ctx, slog.LevelWarn, "nats-consumer: batch failed; its messages are delivered again",
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
	batch, err := c.JS.Fetch(orDefault(c.BatchSize, 100), jetstream.FetchMaxWait(orDefault(c.MaxWait, time.Second)))
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

// item is a decoded message.
type item struct {
	msg jetstream.Msg
	t   Transfer
}

// Handle claims, applies and acks one batch of messages.
func (c *Consumer) Handle(ctx context.Context, msgs []jetstream.Msg) (Stats, error) {
	st := Stats{Fetched: len(msgs)}
	items := make([]item, 0, len(msgs))
	for _, m := range msgs {
		var t Transfer
		if err := json.Unmarshal(m.Data(), &t); err != nil || strings.TrimSpace(t.ID) == "" {
			c.poison(ctx, m, fmt.Errorf("not a transfer with an id: %v", err))
			st.Poison++
			continue
		}
		items = append(items, item{msg: m, t: t})
	}
	// One key order for every batch: of two consumers claiming overlapping
	// batches, one waits for the other's commit; neither holds a key the
	// other waits for, which would stall both for the claim's lock wait.
	slices.SortStableFunc(items, func(a, b item) int { return strings.Compare(a.t.ID, b.t.ID) })

	out, err := c.apply(ctx, items)
	if err != nil {
		// One message's effect failed and rolled the batch back: apply
		// each message alone, so that one message cannot hold up the rest.
		c.logger().LogAttrs(ctx, slog.LevelWarn, "nats-consumer: batch rolled back; applying its messages one by one",
			slog.Int("messages", len(items)), slog.Any("error", err))
		var errs []error
		for _, it := range items {
			o, err := c.apply(ctx, []item{it})
			if err != nil {
				errs = append(errs, err)
				if c.lastDelivery(it.msg) || errors.Is(err, idem.ErrInvalidInput) {
					c.poison(ctx, it.msg, err)
					st.Poison++
				} else {
					_ = it.msg.NakWithDelay(orDefault(c.RetryDelay, time.Second))
					st.Retried++
				}
				continue
			}
			st.add(c.settle(ctx, o))
		}
		return st, errors.Join(errs...)
	}
	st.add(c.settle(ctx, out))
	return st, nil
}

// outcome is what one committed transaction decided for its messages.
type outcome struct {
	applied, duplicates, retry, poison []item
}

// apply claims every item's key and writes the acquired items' effects,
// all in one transaction.
func (c *Consumer) apply(ctx context.Context, items []item) (outcome, error) {
	var o outcome
	err := pgx.BeginFunc(ctx, c.Pool, func(tx pgx.Tx) error {
		o = outcome{}
		ic := c.Idem.WithTx(tx)
		for _, it := range items {
			res, err := ic.Do(ctx, c.source(), it.t.ID, func(ctx context.Context) (any, error) {
				return nil, credit(ctx, tx, it.t)
			}, idem.WithFingerprint(idem.Fingerprint(it.msg.Data())))
			switch {
			case err == nil && res.Replayed:
				o.duplicates = append(o.duplicates, it)
			case err == nil:
				o.applied = append(o.applied, it)
			case errors.Is(err, idem.ErrInProgress):
				// Another consumer's transaction still holds the key.
				o.retry = append(o.retry, it)
			case errors.Is(err, idem.ErrMismatch), errors.Is(err, idem.ErrFailed):
				// The id was used before for another body, or failed for good.
				o.poison = append(o.poison, it)
			default:
				return err
			}
		}
		return nil
	})
	return o, err
}

// credit is the effect: a ledger row and the balance moved by the amount
// (relative, so writing it twice would show).
func credit(ctx context.Context, tx pgx.Tx, t Transfer) error {
	_, err := tx.Exec(ctx, `
		WITH l AS (INSERT INTO ledger (transfer_id, account, cents) VALUES ($1, $2, $3))
		INSERT INTO balances (account, cents) VALUES ($2, $3)
		ON CONFLICT (account) DO UPDATE SET cents = balances.cents + EXCLUDED.cents`,
		t.ID, t.Account, t.Cents)
	return err
}

// settle acks what the committed transaction decided: the acks go out only
// now, so a crash before them leaves the messages to be delivered again,
// and the next delivery finds their keys completed.
func (c *Consumer) settle(ctx context.Context, o outcome) Stats {
	if c.AfterCommit != nil {
		c.AfterCommit()
	}
	for _, it := range o.applied {
		_ = it.msg.Ack()
	}
	for _, it := range o.duplicates {
		_ = it.msg.Ack()
	}
	for _, it := range o.retry {
		_ = it.msg.NakWithDelay(orDefault(c.RetryDelay, time.Second))
	}
	for _, it := range o.poison {
		c.poison(ctx, it.msg, errors.New("the id was used for another body, or failed for good"))
	}
	return Stats{Applied: len(o.applied), Duplicates: len(o.duplicates), Retried: len(o.retry), Poison: len(o.poison)}
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
