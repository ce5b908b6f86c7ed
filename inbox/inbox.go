// Package inbox answers first and processes later: a delivery's key is
// claimed and a River job carrying the verified payload is inserted in one
// transaction, and the sender is answered within milliseconds. A River
// worker then runs the handler under that claim and completes the key in
// the job's own transaction (river.JobCompleteTx), so a job that River
// retries or rescues never repeats a completed event, and the effects of a
// handler that ran half-way (idem.Client.Effect) are replayed, not redone.
//
// Retries use River's backoff, up to a per-source maximum; past it the job
// is discarded: the dead letter, listed by DeadLetters (idemctl inbox
// list) and replayed by Replay (idemctl inbox replay) through the same
// claim, so replaying an event already processed does nothing.
//
// River lives in this package only: applications that do not use the inbox
// do not import it. See docs/inbox.md.
package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/idemkit/idem"
)

// Defaults of Config.
const (
	DefaultQueue       = "idem_inbox"
	DefaultMaxAttempts = 10
	DefaultQueueLease  = time.Hour
	DefaultRunLease    = 2 * time.Minute
	DefaultMaxWorkers  = 50
)

// Kind is the River job kind of inbox jobs.
const Kind = "idem.inbox"

var (
	// ErrInvalidConfig: a Config field is out of range.
	ErrInvalidConfig = errors.New("inbox: invalid config")
	// ErrNoHandler: a worker client was asked for without Config.Handler.
	ErrNoHandler = errors.New("inbox: Config.Handler is required to work jobs")
)

// Handler processes one delivery. It runs in a River worker, under the
// delivery's claim (idem.EventFrom(ctx); idem.Client.Effect works inside
// it), with tx, the transaction in which the key and the job are completed
// when it returns nil: write your data in tx for it to commit exactly once.
// Its result is stored as the key's result (JSON). An error rolls tx back
// and retries the job with River's backoff, up to the source's maximum
// attempts; wrap it with idem.Permanent to dead-letter it at once.
type Handler func(ctx context.Context, tx pgx.Tx, d *Delivery) (any, error)

// Delivery is one event as the inbox keeps it.
type Delivery struct {
	Source, Key, EventType string
	// Fingerprint, when set, is checked like idem.WithFingerprint: the same
	// key with another fingerprint is refused with idem.ErrMismatch.
	Fingerprint string
	Payload     []byte
	// Header holds the request headers worth keeping (idemhttp keeps the
	// sender's event headers); may be nil.
	Header http.Header
	// AcceptedAt is when the delivery was accepted (by this process's
	// clock); Attempt is the job's attempt, 1 the first time.
	AcceptedAt time.Time
	Attempt    int
}

// Config configures an Inbox. Pool is required; every other field's zero
// value means its documented default.
type Config struct {
	// Pool is the database of both idem and River.
	Pool *pgxpool.Pool
	// Idem is the idem client (over Pool). Default: idem.New(Pool, nil).
	Idem *idem.Client
	// Handler processes deliveries; required to work jobs (NewWorkerClient,
	// AddWorker), not to accept them.
	Handler Handler
	// Queue is the River queue of inbox jobs. Default "idem_inbox". An
	// application that runs River itself must not list this queue in its
	// own client unless it also registers the inbox worker (AddWorker).
	Queue string
	// MaxAttempts is the per-source maximum number of attempts of a job
	// before it is dead-lettered; DefaultMaxAttempts applies to sources
	// not listed. Default 10 (River's backoff, attempt^4 seconds, spreads
	// them over about four hours).
	MaxAttempts        map[string]int
	DefaultMaxAttempts int
	// QueueLease is the lease the key holds while its job waits in the
	// queue (and through each retry's backoff, on top of it). Past it, a
	// redelivery of the event takes the key over with a new job, and the
	// stale one does nothing when it runs (fencing). Default 1 hour;
	// between 1 second and 7 days.
	QueueLease time.Duration
	// RunLease is the lease while the handler runs, extended while it
	// does. Default 2 minutes.
	RunLease time.Duration
	// RetryPolicy schedules the retries of failed jobs. Default: River's
	// DefaultClientRetryPolicy (attempt^4 seconds, with jitter).
	RetryPolicy river.ClientRetryPolicy
	// TTL overrides the retention of accepted keys (0: the source's policy).
	TTL time.Duration
	// Schema is the schema of River's tables. Default: the search_path.
	Schema string
	// Logger receives warnings. Default slog.Default().
	Logger *slog.Logger
}

// Inbox accepts deliveries and, with a worker client, processes them.
type Inbox struct {
	cfg    Config
	idem   *idem.Client
	insert *river.Client[pgx.Tx]
}

// New validates cfg and returns an Inbox; it does not touch the database.
func New(cfg Config) (*Inbox, error) {
	if cfg.Pool == nil {
		return nil, fmt.Errorf("%w: Pool is required", ErrInvalidConfig)
	}
	if cfg.Queue == "" {
		cfg.Queue = DefaultQueue
	}
	if cfg.DefaultMaxAttempts == 0 {
		cfg.DefaultMaxAttempts = DefaultMaxAttempts
	}
	if cfg.QueueLease == 0 {
		cfg.QueueLease = DefaultQueueLease
	}
	if cfg.RunLease == 0 {
		cfg.RunLease = DefaultRunLease
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RetryPolicy == nil {
		cfg.RetryPolicy = &river.DefaultClientRetryPolicy{}
	}
	switch {
	case cfg.DefaultMaxAttempts < 1:
		return nil, fmt.Errorf("%w: DefaultMaxAttempts %d must be at least 1 (0 for %d)", ErrInvalidConfig, cfg.DefaultMaxAttempts, DefaultMaxAttempts)
	case cfg.QueueLease < time.Second || cfg.QueueLease > 7*24*time.Hour:
		return nil, fmt.Errorf("%w: QueueLease %v must be between 1s and 7 days (0 for %v)", ErrInvalidConfig, cfg.QueueLease, DefaultQueueLease)
	case cfg.RunLease < time.Second || cfg.RunLease > 7*24*time.Hour:
		return nil, fmt.Errorf("%w: RunLease %v must be between 1s and 7 days (0 for %v)", ErrInvalidConfig, cfg.RunLease, DefaultRunLease)
	case cfg.TTL < 0:
		return nil, fmt.Errorf("%w: TTL %v must not be negative (0 for the source's policy)", ErrInvalidConfig, cfg.TTL)
	}
	for src, n := range cfg.MaxAttempts {
		if n < 1 {
			return nil, fmt.Errorf("%w: MaxAttempts[%q] = %d must be at least 1", ErrInvalidConfig, src, n)
		}
	}
	in := &Inbox{cfg: cfg, idem: cfg.Idem}
	if in.idem == nil {
		in.idem = idem.New(cfg.Pool, &idem.Config{Logger: cfg.Logger})
	}
	var err error
	in.insert, err = river.NewClient(riverpgxv5.New(cfg.Pool), &river.Config{Logger: quiet(cfg.Logger), Schema: cfg.Schema})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidConfig, err)
	}
	return in, nil
}

// quiet passes River's own log on at warning level and above.
func quiet(l *slog.Logger) *slog.Logger {
	return slog.New(&minLevel{h: l.Handler(), min: slog.LevelWarn})
}

type minLevel struct {
	h   slog.Handler
	min slog.Level
}

func (m *minLevel) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= m.min && m.h.Enabled(ctx, l)
}
func (m *minLevel) Handle(ctx context.Context, r slog.Record) error { return m.h.Handle(ctx, r) }
func (m *minLevel) WithAttrs(a []slog.Attr) slog.Handler {
	return &minLevel{h: m.h.WithAttrs(a), min: m.min}
}
func (m *minLevel) WithGroup(g string) slog.Handler {
	return &minLevel{h: m.h.WithGroup(g), min: m.min}
}

// maxAttempts returns the source's maximum attempts.
func (in *Inbox) maxAttempts(source string) int {
	if n, ok := in.cfg.MaxAttempts[source]; ok {
		return n
	}
	return in.cfg.DefaultMaxAttempts
}

// Queue returns the River queue of inbox jobs.
func (in *Inbox) Queue() string { return in.cfg.Queue }
