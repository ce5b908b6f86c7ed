// Package inbox answers first and processes later: a delivery's key is
// claimed and a River job carrying the verified payload is inserted in one
// transaction, and the sender is answered within milliseconds. A River
// worker then runs the handler under that claim and completes the key in
// the job's own transaction (river.JobCompleteTx), so a job that River
// retries or rescues never repeats a completed event, and the effects of a
// handler that ran half-way (idem.Client.Effect) are replayed, not redone.
//
// From the accept until its job completes it or dead-letters it, the key
// is held for the queue (idem.holds, migration 7): no claim acquires it,
// prune does not delete it and rotation does not retire its month, however
// long the workers are down. Each attempt of a job takes the key with a
// token of its own, so two attempts (a job River rescued while its first
// attempt still ran) never both commit.
//
// Retries use River's backoff, up to a per-source maximum; past it the job
// is discarded: the dead letter, listed by DeadLetters (idemctl inbox
// list) and replayed by Replay (idemctl inbox replay) through the same
// claim, so replaying an event already processed does nothing. A job whose
// key is gone (deleted by hand, its month dropped) is a dead letter too,
// with that reason, never a silent completion. Reconcile counts, per
// source, accepted = processed + dead-lettered + queued.
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
	"sync"
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
	DefaultRunLease    = 2 * time.Minute
	// DefaultMaxWorkers bounds NewWorkerClient(0, ...): as many handlers
	// as the pool serves, at most this many.
	DefaultMaxWorkers = 50
	// DefaultRepairEvery is how often a worker client looks for queued
	// events whose job can no longer run them (Repair).
	DefaultRepairEvery = time.Minute
)

// Kind is the River job kind of inbox jobs.
const Kind = "idem.inbox"

var (
	// ErrInvalidConfig: a Config field is out of range.
	ErrInvalidConfig = errors.New("inbox: invalid config")
	// ErrNoHandler: a worker was asked for, or a job ran, with no handler
	// for its source (Config.Handler, Inbox.HTTP or Inbox.Handle).
	ErrNoHandler = errors.New("inbox: no handler: set Config.Handler, or route a source with Inbox.HTTP or Inbox.Handle")
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
	// Header holds the request headers kept with the delivery, stored with
	// its job and handed to the handler: idemhttp keeps an allow-list
	// (Content-Type, User-Agent, the sender's event, delivery and
	// signature headers, and its Config.KeepHeaders), never credentials.
	// May be nil.
	Header http.Header
	// AcceptedAt is when the delivery was accepted (by this process's
	// clock); Attempt is the job's attempt, 1 the first time.
	AcceptedAt time.Time
	Attempt    int
	// TTL and Lease, when set, override Config.TTL and Config.RunLease for
	// this delivery (idemhttp passes its Config.TTL and Config.Lease, so
	// a sender preset's retention holds in both modes).
	TTL, Lease time.Duration
	// GuardSource and GuardKey, when set (idemhttp's GitHub and Shopify
	// presets: their signatures cover the body only), are claimed in the
	// accept's transaction with Key as fingerprint: a copy of the signed
	// body under another delivery id is a duplicate (idemhttp.GuardKey).
	GuardSource, GuardKey string
	// Method is the request's method, Target the request target the
	// delivery arrived at (path and query, idemhttp.RequestTarget), Host
	// its host, Pattern the http.ServeMux pattern that routed it: stored
	// with its job, so that FromHTTP replays the request as it arrived, as
	// the same method at the same URL, with the route values (r.PathValue)
	// the router gave it. idemhttp sets them; "" replays as POST (what
	// every delivery was replayed as before the method was kept) at "/"
	// with no route.
	Method, Target, Host, Pattern string
	// Principal is what idemhttp's Config.Scope named for the request ("":
	// none), stored with its job and handed to FromHTTP's handler
	// (idemhttp.Principal). An identifier, never a credential.
	Principal string
}

// Config configures an Inbox. Pool is required; every other field's zero
// value means its documented default.
type Config struct {
	// Pool is the database of both idem and River.
	Pool *pgxpool.Pool
	// Idem is the idem client (over Pool). Default: idem.New(Pool, nil).
	Idem *idem.Client
	// Handler processes the deliveries of every source that has no handler
	// of its own (Inbox.HandleHTTP, Inbox.HTTP, Inbox.Handle). A worker (NewWorkerClient,
	// AddWorker) needs it or at least one routed source; accepting does
	// not. Default: none.
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
	// RunLease is each attempt's lease on the key while the handler runs,
	// extended while it does; a delivery's own Lease (idemhttp's
	// Config.Lease, a preset's) overrides it. While the job waits in the
	// queue or between attempts the key is held for it, whatever its
	// lease: no lease runs out under a queued event. Default 2 minutes;
	// between 1 second and 7 days.
	RunLease time.Duration
	// RetryPolicy schedules the retries of failed jobs. Default: River's
	// DefaultClientRetryPolicy (attempt^4 seconds, with jitter).
	RetryPolicy river.ClientRetryPolicy
	// TTL overrides the retention of accepted keys (0: the source's policy);
	// a delivery's own TTL (idemhttp's Config.TTL, a preset's) overrides
	// it. Retention counts from the first delivery; a key held for its job
	// is kept past it until the job has run.
	TTL time.Duration
	// RepairEvery is how often the worker client's Repair runs. Default
	// DefaultRepairEvery; negative: never (call Repair yourself).
	RepairEvery time.Duration
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

	mu     sync.RWMutex
	routes map[string]Handler // per-source handlers (Handle, HTTP)

	citus citusState // refuseCitus
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
	if cfg.RunLease == 0 {
		cfg.RunLease = DefaultRunLease
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.RepairEvery == 0 {
		cfg.RepairEvery = DefaultRepairEvery
	}
	if cfg.RetryPolicy == nil {
		cfg.RetryPolicy = &river.DefaultClientRetryPolicy{}
	}
	switch {
	case cfg.DefaultMaxAttempts < 1:
		return nil, fmt.Errorf("%w: DefaultMaxAttempts %d must be at least 1 (0 for %d)", ErrInvalidConfig, cfg.DefaultMaxAttempts, DefaultMaxAttempts)
	case cfg.RunLease < time.Second || cfg.RunLease > 7*24*time.Hour:
		return nil, fmt.Errorf("%w: RunLease %v must be between 1s and 7 days (0 for %v)", ErrInvalidConfig, cfg.RunLease, DefaultRunLease)
	case cfg.RepairEvery > 0 && cfg.RepairEvery < time.Second:
		return nil, fmt.Errorf("%w: RepairEvery %v must be at least 1s (0 for %v, negative for never)", ErrInvalidConfig, cfg.RepairEvery, DefaultRepairEvery)
	case cfg.TTL < 0:
		return nil, fmt.Errorf("%w: TTL %v must not be negative (0 for the source's policy)", ErrInvalidConfig, cfg.TTL)
	}
	for src, n := range cfg.MaxAttempts {
		if n < 1 {
			return nil, fmt.Errorf("%w: MaxAttempts[%q] = %d must be at least 1", ErrInvalidConfig, src, n)
		}
	}
	in := &Inbox{cfg: cfg, idem: cfg.Idem}
	var err error
	if in.idem == nil {
		if in.idem, err = idem.New(cfg.Pool, &idem.Config{Logger: cfg.Logger}); err != nil {
			return nil, err
		}
	}
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
