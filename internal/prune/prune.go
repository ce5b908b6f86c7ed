// Package prune deletes expired keys in small batches, the way river's job
// cleaner does: DELETE up to N rows, commit, sleep with jitter, repeat until
// a short batch. One prune runs at a time per database, gated by the
// maintenance lock 'prune' (a lease in idem.maintenance_locks taken under
// a transaction-scoped advisory lock, so it is safe through PgBouncer's
// transaction pooling and ends by itself if the process dies).
//
// Every batch is its own transaction, so killing prune at any point leaves
// no half-done state: what was committed is deleted, the rest is not.
package prune

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/dbutil"
	"github.com/idemkit/idem/internal/maintlock"
)

// LockName is the maintenance lock prune takes.
const LockName = "prune"

// Config configures a prune run.
type Config struct {
	// BatchSize is the most rows one batch deletes. Default 5000.
	BatchSize int
	// Sleep is the pause between batches, jittered by +-50% so that several
	// databases pruned from one host do not pulse together. Default 100ms.
	Sleep time.Duration
	// MaxDuration bounds the run; it stops after the batch that crosses it.
	// Default 0: until no expired rows are left.
	MaxDuration time.Duration
	// LockTTL is the lease of the prune lock, renewed before every batch; a
	// killed prune blocks the next one for at most this long. Default 30s.
	LockTTL time.Duration
	// LockTimeout and StatementTimeout are set for each batch's transaction
	// (SET LOCAL, so they hold through PgBouncer). Defaults 2s and 5m.
	LockTimeout, StatementTimeout time.Duration
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
}

// ErrLockLost means the lease expired mid-run (the process stalled for
// longer than LockTTL) and prune stopped rather than run alongside another.
var ErrLockLost = errors.New("prune: lost the prune lock mid-run")

func (c *Config) defaults() error {
	if c.BatchSize == 0 {
		c.BatchSize = 5000
	}
	if c.BatchSize < 1 || c.BatchSize > 1_000_000 {
		return fmt.Errorf("batch size %d is out of range (1 to 1000000)", c.BatchSize)
	}
	if c.Sleep == 0 {
		c.Sleep = 100 * time.Millisecond
	}
	if c.Sleep < 0 || c.MaxDuration < 0 || c.LockTTL < 0 {
		return errors.New("sleep, max duration and lock ttl must not be negative")
	}
	if c.LockTTL == 0 {
		c.LockTTL = 30 * time.Second
	}
	if c.LockTimeout <= 0 {
		c.LockTimeout = 2 * time.Second
	}
	if c.StatementTimeout <= 0 {
		c.StatementTimeout = 5 * time.Minute
	}
	if c.Holder == "" {
		c.Holder = maintlock.NewHolderID()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Run prunes expired rows from pool's database.
func Run(ctx context.Context, pool *pgxpool.Pool, cfg Config) (*Result, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	q := pgxdb.New(pool)
	lock := maintlock.New(q, LockName, cfg.Holder, cfg.LockTTL)
	held, err := lock.Take(ctx, cfg.Logger)
	if err != nil {
		return nil, err
	}
	if !held.Acquired {
		return &Result{Skipped: true, Holder: held}, nil
	}
	defer lock.Release(ctx, cfg.Logger)

	res := &Result{Stopped: "done"}
	if cfg.DryRun {
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
		if cfg.MaxDuration > 0 && time.Since(start) >= cfg.MaxDuration {
			res.Stopped = "max-duration"
			break
		}
		if held, err := lock.Acquire(ctx); err != nil {
			return res, err
		} else if !held.Acquired {
			return res, fmt.Errorf("%w (now held by %s)", ErrLockLost, held.Holder)
		}
		// The batch is not cancelled with ctx: on SIGTERM the current batch
		// finishes (it is short) and the loop stops before the next one.
		n, err := cfg.batch(context.WithoutCancel(ctx), pool)
		if err != nil {
			var pg *pgconn.PgError
			if errors.As(err, &pg) && pg.Code == "55P03" {
				return res, fmt.Errorf("%w: %s", ErrLockLost, pg.Message)
			}
			return res, fmt.Errorf("prune batch: %w", err)
		}
		res.Deleted += n
		res.Batches++
		res.Elapsed = time.Since(start)
		if cfg.Progress != nil {
			cfg.Progress(res.Progress)
		}
		if time.Since(lastLog) >= 5*time.Second {
			lastLog = time.Now()
			cfg.Logger.LogAttrs(ctx, slog.LevelInfo, "prune progress",
				slog.Int64("deleted", res.Deleted), slog.Int("batches", res.Batches),
				slog.Float64("rows_per_second", res.Rate()))
		}
		if n < int64(cfg.BatchSize) {
			break
		}
		if !sleep(ctx, jitter(cfg.Sleep)) {
			res.Stopped = "interrupted"
			break
		}
	}
	res.Elapsed = time.Since(start)
	return res, nil
}

// batch deletes one batch in a transaction of its own.
func (c *Config) batch(ctx context.Context, pool *pgxpool.Pool) (n int64, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := dbutil.SetLocalTimeouts(ctx, tx, c.LockTimeout, c.StatementTimeout); err != nil {
			return err
		}
		n, err = pgxdb.New(tx).PruneBatch(ctx, pgxdb.PruneBatchParams{Holder: c.Holder, BatchSize: int32(c.BatchSize)})
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
