// Package partition rotates idem.processed_events' monthly partitions:
// premake the months ahead, move rows that landed in the default partition
// into their month, and retire past months whose rows have all expired.
//
// Every DDL step runs in its own short transaction with SET LOCAL
// lock_timeout, so a long transaction on the table makes rotation wait at
// most that long (and claims queue behind rotation's lock request at most
// that long); the step is retried with backoff, then left for the next run.
// Rotation is gated by the maintenance lock 'rotate'.
package partition

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

// LockName is the maintenance lock rotation takes.
const LockName = "rotate"

// Config configures a rotation.
type Config struct {
	// Premake is how many months after the current one must have a
	// partition. Default 3.
	Premake int
	// KeepDetached retires months by DETACH instead of DROP, leaving the
	// table for archiving. Default false (drop).
	KeepDetached bool
	// LockTimeout bounds each DDL step's wait for its locks. Default 2s.
	LockTimeout time.Duration
	// StatementTimeout bounds each step (moving rows out of the default
	// partition can take a while). Default 5m.
	StatementTimeout time.Duration
	// Retries is how many times a step that timed out on a lock is tried
	// again (with doubling, jittered backoff from Backoff). Default 4.
	Retries int
	// Backoff is the first pause before a retry. Default 500ms.
	Backoff time.Duration
	// LockTTL is the lease of the rotate lock. Default 5m.
	LockTTL time.Duration
	// Holder identifies this run in the lock table. Default host:pid:random.
	Holder string
	// Logger receives each step. Default: discard.
	Logger *slog.Logger
}

func (c *Config) defaults() error {
	if c.Premake == 0 {
		c.Premake = 3
	}
	if c.Premake < 0 || c.Premake > 120 {
		return fmt.Errorf("premake %d is out of range (0 to 120 months)", c.Premake)
	}
	if c.LockTimeout == 0 {
		c.LockTimeout = 2 * time.Second
	}
	if c.LockTimeout < 0 || c.Retries < 0 || c.Backoff < 0 || c.LockTTL < 0 {
		return errors.New("lock timeout, retries, backoff and lock ttl must not be negative")
	}
	if c.StatementTimeout <= 0 {
		c.StatementTimeout = 5 * time.Minute
	}
	if c.Retries == 0 {
		c.Retries = 4
	}
	if c.Backoff == 0 {
		c.Backoff = 500 * time.Millisecond
	}
	if c.LockTTL == 0 {
		c.LockTTL = 5 * time.Minute
	}
	if c.Holder == "" {
		c.Holder = maintlock.NewHolderID()
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return nil
}

// Step is one thing rotation did or tried.
type Step struct {
	Action string // "create" or "retire"
	Target string // month (create) or partition (retire)
	Result string // "created", "dropped", "detached", "kept: ...", "gave up: ..."
}

// Result is the outcome of a rotation.
type Result struct {
	Skipped bool
	Holder  maintlock.Holder // with Skipped: who holds the lock
	Steps   []Step
	GaveUp  int // steps left for the next run after lock timeouts
}

// ErrIncomplete is returned (with the Result) when some steps gave up
// after lock timeouts; the next run tries them again.
var ErrIncomplete = errors.New("rotation incomplete: some steps could not get their locks in time")

// Partition is one partition of processed_events.
type Partition = pgxdb.ListPartitionsRow

// List returns the partitions, months in order, the default one last.
func List(ctx context.Context, pool *pgxpool.Pool) ([]Partition, error) {
	return pgxdb.New(pool).ListPartitions(ctx)
}

// Rotate runs one rotation.
func Rotate(ctx context.Context, pool *pgxpool.Pool, cfg Config) (*Result, error) {
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

	res := &Result{}
	months, err := q.MonthsToCreate(ctx, int32(cfg.Premake))
	if err != nil {
		return res, fmt.Errorf("list months to create: %w", err)
	}
	for _, m := range months {
		month := m.Time.Format("2006-01")
		out, err := cfg.step(ctx, pool, func(q *pgxdb.Queries) (string, error) {
			if _, err := q.CreatePartition(ctx, m); err != nil {
				return "", err
			}
			return "created", nil
		})
		if err != nil {
			return res, fmt.Errorf("create the partition for %s: %w", month, err)
		}
		res.add(ctx, cfg, Step{"create", month, out})
	}

	parts, err := q.ListPartitions(ctx)
	if err != nil {
		return res, fmt.Errorf("list partitions: %w", err)
	}
	thisMonth, err := q.CurrentMonth(ctx) // the database's clock decides
	if err != nil {
		return res, err
	}
	for _, p := range parts {
		if p.IsDefault || !p.MonthTo.Valid || p.MonthTo.Time.After(thisMonth.Time) {
			continue
		}
		// Detach first and drop in a second transaction: the lock on
		// processed_events, which claims queue behind, lasts only the detach.
		out, err := cfg.step(ctx, pool, func(q *pgxdb.Queries) (string, error) {
			return q.RetirePartition(ctx, pgxdb.RetirePartitionParams{Name: p.Name, KeepDetached: true})
		})
		if err != nil {
			return res, fmt.Errorf("retire %s: %w", p.Name, err)
		}
		if out == "detached" && !cfg.KeepDetached {
			out, err = cfg.step(ctx, pool, func(q *pgxdb.Queries) (string, error) {
				return q.DropDetached(ctx, p.Name)
			})
			if err != nil {
				return res, fmt.Errorf("drop %s: %w", p.Name, err)
			}
		}
		res.add(ctx, cfg, Step{"retire", p.Name, out})
	}
	if res.GaveUp > 0 {
		return res, ErrIncomplete
	}
	return res, nil
}

func (r *Result) add(ctx context.Context, cfg Config, s Step) {
	r.Steps = append(r.Steps, s)
	if len(s.Result) >= 7 && s.Result[:7] == "gave up" {
		r.GaveUp++
	}
	cfg.Logger.LogAttrs(ctx, slog.LevelInfo, "rotate",
		slog.String("action", s.Action), slog.String("target", s.Target), slog.String("result", s.Result))
}

// step runs fn in a transaction with SET LOCAL lock_timeout, retrying with
// backoff when it times out on a lock. After the last try it reports
// "gave up: ..." instead of an error: the next run will try again.
func (c Config) step(ctx context.Context, pool *pgxpool.Pool, fn func(q *pgxdb.Queries) (string, error)) (string, error) {
	wait := c.Backoff
	for try := 0; ; try++ {
		out, err := c.tx(ctx, pool, fn)
		if err == nil {
			return out, nil
		}
		if !isLockTimeout(err) {
			return "", err
		}
		if try >= c.Retries {
			return fmt.Sprintf("gave up: locks not available within %s after %d tries", c.LockTimeout, try+1), nil
		}
		c.Logger.LogAttrs(ctx, slog.LevelWarn, "rotate step timed out on a lock; retrying",
			slog.Int("try", try+1), slog.Duration("backoff", wait))
		t := time.NewTimer(time.Duration(float64(wait) * (0.5 + rand.Float64())))
		select {
		case <-ctx.Done():
			t.Stop()
			return "", ctx.Err()
		case <-t.C:
		}
		wait *= 2
	}
}

func (c Config) tx(ctx context.Context, pool *pgxpool.Pool, fn func(q *pgxdb.Queries) (string, error)) (string, error) {
	var out string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := dbutil.SetLocalTimeouts(ctx, tx, c.LockTimeout, c.StatementTimeout); err != nil {
			return err
		}
		var err error
		out, err = fn(pgxdb.New(tx))
		return err
	})
	return out, err
}

func isLockTimeout(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "55P03"
}
