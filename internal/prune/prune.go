// Package prune deletes expired keys in small batches, the way river's job
// cleaner does: DELETE up to N rows, commit, sleep with jitter, repeat until
// a short batch. One prune runs at a time per database, gated by the
// maintenance lock 'prune' (a lease row in idem.maintenance_locks that
// only idem's functions write: no other login can hold or stall it; it is
// safe through PgBouncer's transaction pooling and ends by itself if the
// process dies).
//
// Every batch is its own transaction, so killing prune at any point leaves
// no half-done state: what was committed is deleted, the rest is not.
package prune

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/dbutil"
	"github.com/idemkit/idem/internal/maintcfg"
	"github.com/idemkit/idem/internal/maintlock"
	"github.com/idemkit/idem/internal/sqlstate"
)

// LockName is the maintenance lock prune takes.
const LockName = "prune"

// Defaults of Config's fields.
const (
	DefaultBatchSize        = 5000
	DefaultSleep            = 100 * time.Millisecond
	DefaultLockTimeout      = 2 * time.Second
	DefaultStatementTimeout = 5 * time.Minute
	DefaultRetries          = 3
)

// Config configures a prune run. Settings are pointers so that unset is
// told apart from zero: nil means the documented default, anything given
// is validated and honoured (a Sleep of 0 is no pause, Retries 0 no retry;
// Go 1.26: Sleep: new(0 * time.Second)). The zero Config is the defaults;
// Validate says what is wrong with one.
type Config struct {
	// BatchSize is the most rows one batch deletes, 1 to 1000000. nil:
	// DefaultBatchSize (5000).
	BatchSize *int
	// Sleep is the pause between batches, jittered by +-50% so that several
	// databases pruned from one host do not pulse together. nil:
	// DefaultSleep (100ms); 0: none.
	Sleep *time.Duration
	// MaxDuration bounds the run; it stops after the batch that crosses it.
	// 0 (the default): until no expired rows are left.
	MaxDuration time.Duration
	// LockTTL is the lease of the prune lock, renewed before every batch; a
	// killed prune blocks the next one for at most this long, and a batch
	// that takes longer loses the lock (ErrLockLost). The database's
	// default for the lock is idem.lock_ttl('prune') (30s), the lease CALL
	// idem.prune() takes too. nil: that default; otherwise 1ms to 24h.
	LockTTL *time.Duration
	// LockTimeout is set for each batch's transaction (SET LOCAL, so it
	// holds through PgBouncer): how long a batch waits for a table lock
	// (rotation detaching a month). Must be positive: without one a batch
	// could wait behind a DDL without limit. nil: DefaultLockTimeout (2s).
	LockTimeout *time.Duration
	// StatementTimeout bounds each batch. nil: DefaultStatementTimeout (5m);
	// 0: none.
	StatementTimeout *time.Duration
	// Retries is how many times a batch that timed out on a lock is tried
	// again, after Sleep (doubling). nil: DefaultRetries (3); 0: none.
	Retries *int
	// DryRun counts what would be deleted and deletes nothing.
	DryRun bool
	// Holder identifies this run in the lock table. Default host:pid:random.
	Holder string
	// Logger receives progress. Default: discard.
	Logger *slog.Logger
	// Progress, when set, is called after every batch.
	Progress func(Progress)
}

// Progress is the state after a batch.
type Progress struct {
	Deleted int64
	Batches int
	Elapsed time.Duration
}

// Rate is rows deleted per second so far.
func (p Progress) Rate() float64 {
	if p.Elapsed <= 0 {
		return 0
	}
	return float64(p.Deleted) / p.Elapsed.Seconds()
}

// Result is the outcome of a run.
type Result struct {
	Progress
	// Skipped: another prune held the lock; nothing was done.
	Skipped bool
	Holder  maintlock.Holder // with Skipped: who holds the lock
	// DryRun: nothing was deleted; WouldDelete is how many rows would be.
	DryRun      bool
	WouldDelete int64
	// Stopped says why the loop ended: "done", "max-duration" or "interrupted".
	Stopped string
	// Folded is how many per-backend rows of idem.duplicate_counts were
	// folded into their source's row after the last batch (only when
	// Stopped is "done").
	Folded int64
}

// ErrLockLost means the lease expired mid-run (the process stalled for
// longer than LockTTL) and prune stopped rather than run alongside another.
var ErrLockLost = errors.New("prune: lost the prune lock mid-run")

// ErrLockTimeout means batches kept timing out waiting for a table lock
// (lock_timeout, SQLSTATE 55P03), Retries times; the lock is not lost and
// the next run goes on where this one stopped.
var ErrLockTimeout = errors.New("prune: batches kept timing out on a table lock")

// ErrInvalidConfig is matched by Validate's errors.
var ErrInvalidConfig = maintcfg.ErrInvalidConfig

// ConfigError names the Config field Validate refused and why.
type ConfigError = maintcfg.Error

// Validate reports the first bad field of c as a *ConfigError.
func (c Config) Validate() error {
	bad := func(field, format string, a ...any) error { return maintcfg.Bad("prune", field, format, a...) }
	switch {
	case c.BatchSize != nil && (*c.BatchSize < 1 || *c.BatchSize > 1_000_000):
		return bad("BatchSize", "%d is out of range (1 to 1000000)", *c.BatchSize)
	case c.Sleep != nil && *c.Sleep < 0:
		return bad("Sleep", "%s is negative", *c.Sleep)
	case c.MaxDuration < 0:
		return bad("MaxDuration", "%s is negative", c.MaxDuration)
	case c.LockTTL != nil && (*c.LockTTL < time.Millisecond || *c.LockTTL > 24*time.Hour):
		return bad("LockTTL", "%s is out of range (1ms to 24h)", *c.LockTTL)
	case c.LockTimeout != nil && *c.LockTimeout < time.Millisecond:
		return bad("LockTimeout", "%s must be at least 1ms: without one a batch could wait behind a DDL without limit", *c.LockTimeout)
	case c.LockTimeout != nil && *c.LockTimeout > maintcfg.MaxTimeout:
		return bad("LockTimeout", "%s is over PostgreSQL's limit (%s)", *c.LockTimeout, maintcfg.MaxTimeout)
	case c.StatementTimeout != nil && (*c.StatementTimeout < 0 || *c.StatementTimeout > maintcfg.MaxTimeout ||
		(*c.StatementTimeout > 0 && *c.StatementTimeout < time.Millisecond)):
		return bad("StatementTimeout", "%s is out of range (0 for none, or 1ms to %s, PostgreSQL's limit)", *c.StatementTimeout, maintcfg.MaxTimeout)
	case c.Retries != nil && *c.Retries < 0:
		return bad("Retries", "%d is negative", *c.Retries)
	}
	return nil
}

// settings is a validated Config with its defaults filled in.
type settings struct {
	batchSize                int
	sleep, maxDuration       time.Duration
	lockTTL                  time.Duration
	lockTimeout, stmtTimeout time.Duration
	retries                  int
	dryRun                   bool
	holder                   string
	log                      *slog.Logger
	progress                 func(Progress)
}

func (c Config) settings() (settings, error) {
	if err := c.Validate(); err != nil {
		return settings{}, err
	}
	s := settings{
		batchSize:   maintcfg.Or(c.BatchSize, DefaultBatchSize),
		sleep:       maintcfg.Or(c.Sleep, DefaultSleep),
		maxDuration: c.MaxDuration,
		lockTTL:     maintcfg.Or(c.LockTTL, 0), // 0: the database's default
		lockTimeout: maintcfg.Or(c.LockTimeout, DefaultLockTimeout),
		stmtTimeout: maintcfg.Or(c.StatementTimeout, DefaultStatementTimeout),
		retries:     maintcfg.Or(c.Retries, DefaultRetries),
		dryRun:      c.DryRun,
		holder:      c.Holder,
		log:         cmp.Or(c.Logger, slog.New(slog.DiscardHandler)),
		progress:    c.Progress,
	}
	if s.holder == "" {
		s.holder = maintlock.NewHolderID()
	}
	return s, nil
}

// Run prunes expired rows from pool's database: the steps of CALL
// idem.prune() (idem.try_lock, idem.prune_batch until a short batch,
// idem.compact_duplicate_counts, idem.release_lock), driven from Go with
// pacing, retries, progress and logs.
func Run(ctx context.Context, pool *pgxpool.Pool, cfg Config) (*Result, error) {
	c, err := cfg.settings()
	if err != nil {
		return nil, err
	}
	started := time.Now()
	res, err := c.run(ctx, pool)
	if res == nil || res.DryRun {
		return res, err
	}
	// The run as the dashboard shows it (idem.runs).
	r := maintlock.Run{Job: LockName, Started: started, Outcome: "ok", Err: err, Holder: c.holder,
		Figures: map[string]any{"deleted": res.Deleted, "batches": res.Batches, "folded": res.Folded,
			"stopped": res.Stopped}}
	switch {
	case err != nil:
		r.Outcome = "error"
	case res.Skipped:
		r.Outcome, r.Figures = "skipped", map[string]any{"holder": res.Holder.Holder}
	case res.Stopped == "interrupted":
		r.Outcome = "interrupted"
	}
	maintlock.Record(ctx, pgxdb.New(pool), c.log, r)
	return res, err
}

func (c settings) run(ctx context.Context, pool *pgxpool.Pool) (*Result, error) {
	q := pgxdb.New(pool)
	lock := maintlock.New(q, LockName, c.holder, c.lockTTL)
	held, err := lock.Take(ctx, c.log)
	if err != nil {
		return nil, err
	}
	if !held.Acquired {
		return &Result{Skipped: true, Holder: held}, nil
	}
	defer lock.Release(ctx, c.log)

	res := &Result{Stopped: "done"}
	if c.dryRun {
		res.DryRun = true
		res.WouldDelete, err = q.PrunableRows(ctx)
		return res, err
	}
	start := time.Now()
	lastLog := start
	for {
		if ctx.Err() != nil {
			res.Stopped = "interrupted"
			break
		}
		if c.maxDuration > 0 && time.Since(start) >= c.maxDuration {
			res.Stopped = "max-duration"
			break
		}
		n, err := c.batchWithRetries(ctx, pool, lock)
		if err != nil {
			return res, err
		}
		res.Deleted += n
		res.Batches++
		res.Elapsed = time.Since(start)
		if c.progress != nil {
			c.progress(res.Progress)
		}
		if time.Since(lastLog) >= 5*time.Second {
			lastLog = time.Now()
			c.log.LogAttrs(ctx, slog.LevelInfo, "prune progress",
				slog.Int64("deleted", res.Deleted), slog.Int("batches", res.Batches),
				slog.Float64("rows_per_second", res.Rate()))
		}
		if n < int64(c.batchSize) {
			break
		}
		if !sleep(ctx, jitter(c.sleep)) {
			res.Stopped = "interrupted"
			break
		}
	}
	if res.Stopped == "done" {
		// Fold the per-backend duplicate counts of version 5 into one row
		// per source, as CALL idem.prune() does.
		res.Folded, err = q.CompactDuplicateCounts(context.WithoutCancel(ctx))
		if err != nil {
			return res, fmt.Errorf("compact duplicate counts: %w", err)
		}
	}
	res.Elapsed = time.Since(start)
	return res, nil
}

// batchWithRetries renews the lock and deletes one batch, trying again
// (after the sleep, doubling) when the batch timed out waiting for a lock.
func (c settings) batchWithRetries(ctx context.Context, pool *pgxpool.Pool, lock *maintlock.Lock) (int64, error) {
	wait := c.sleep
	for try := 0; ; try++ {
		if held, err := lock.Acquire(ctx); err != nil {
			return 0, err
		} else if !held.Acquired {
			return 0, fmt.Errorf("%w (now held by %s)", ErrLockLost, held.Holder)
		}
		// The batch is not cancelled with ctx: on SIGTERM the current batch
		// finishes (it is short) and the loop stops before the next one.
		n, err := c.batch(context.WithoutCancel(ctx), pool)
		switch sqlstate.Of(err) {
		case "":
			if err != nil {
				return 0, fmt.Errorf("prune batch: %w", err)
			}
			return n, nil
		case sqlstate.LockNotHeld:
			return 0, fmt.Errorf("%w: %w", ErrLockLost, err)
		case sqlstate.LockNotAvailable:
			if try >= c.retries {
				return 0, fmt.Errorf("%w: a batch waited %s for a table lock %d times (is a rotation or a long transaction holding idem.processed_events?): %w",
					ErrLockTimeout, c.lockTimeout, try+1, err)
			}
			c.log.LogAttrs(ctx, slog.LevelWarn, "prune batch timed out on a lock; retrying",
				slog.Int("try", try+1), slog.Duration("lock_timeout", c.lockTimeout))
			if !sleep(ctx, jitter(wait)) {
				return 0, ctx.Err()
			}
			wait = max(2*wait, time.Millisecond)
		default:
			return 0, fmt.Errorf("prune batch: %w", err)
		}
	}
}

// batch deletes one batch in a transaction of its own.
func (c settings) batch(ctx context.Context, pool *pgxpool.Pool) (n int64, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := dbutil.SetLocalTimeouts(ctx, tx, c.lockTimeout, c.stmtTimeout); err != nil {
			return err
		}
		n, err = pgxdb.New(tx).PruneBatch(ctx, pgxdb.PruneBatchParams{Holder: c.holder, BatchSize: int32(c.batchSize)})
		return err
	})
	return n, err
}

// jitter returns d scaled by a random factor in [0.5, 1.5).
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.5 + rand.Float64()))
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
