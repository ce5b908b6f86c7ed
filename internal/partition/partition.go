// Package partition rotates idem.processed_events' monthly partitions:
// premake the months ahead and retire past months whose rows have all
// expired. Rows that landed in the default partition stay there until
// prune deletes them, and their months get no partition meanwhile, unless
// Config.MoveDefault is set: then each such month's rows are moved into a
// new partition of the month (idem.move_default_month), in one short
// transaction per month that holds the default partition's lock, which
// claims of months without a partition wait for, as long as the copy
// takes (months with more than MaxMoveRows rows are left as they are).
//
// Every DDL step runs in its own short transaction with SET LOCAL
// lock_timeout, so a long transaction on the table makes rotation wait at
// most that long (and claims queue behind rotation's lock request at most
// that long); the step is retried with backoff, then left for the next run.
// Rotation is gated by the maintenance lock 'rotate'.
package partition

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/dbutil"
	"github.com/idemkit/idem/internal/maintcfg"
	"github.com/idemkit/idem/internal/maintlock"
	"github.com/idemkit/idem/internal/sqlstate"
)

// LockName is the maintenance lock rotation takes.
const LockName = "rotate"

// Defaults of Config's fields.
const (
	DefaultPremake          = 3
	DefaultLockTimeout      = 2 * time.Second
	DefaultStatementTimeout = 5 * time.Minute
	DefaultRetries          = 4
	DefaultBackoff          = 500 * time.Millisecond
	DefaultMaxMoveRows      = 50_000
)

// Config configures a rotation. Settings are pointers so that unset is
// told apart from zero: nil means the documented default, anything given is
// validated and honoured (Premake 0 makes no month ahead, Retries 0 tries
// once; Go 1.26: Premake: new(0)). The zero Config is the defaults;
// Validate says what is wrong with one.
type Config struct {
	// Premake is how many months after the current one must have a
	// partition, 0 to 24 (idem.check_rotate_args). nil: DefaultPremake
	// (3), as CALL idem.rotate().
	Premake *int
	// KeepDetached retires months by DETACH instead of DROP, leaving the
	// table for archiving. Default false (drop).
	KeepDetached bool
	// LockTimeout bounds each DDL step's wait for its locks (and so how
	// long claims can queue behind rotation's lock request), 1ms to 1h
	// (idem.check_rotate_args). nil: DefaultLockTimeout (2s).
	LockTimeout *time.Duration
	// StatementTimeout bounds each step (attaching a month reads the
	// default partition). nil: DefaultStatementTimeout (5m); 0: none.
	StatementTimeout *time.Duration
	// Retries is how many times a step that timed out on a lock is tried
	// again (with doubling, jittered backoff from Backoff). nil:
	// DefaultRetries (4); 0: none, as CALL idem.rotate().
	Retries *int
	// Backoff is the first pause before a retry. nil: DefaultBackoff
	// (500ms); 0: none.
	Backoff *time.Duration
	// LockTTL is the lease of the rotate lock, 1ms to 24h. nil: the
	// database's default, idem.lock_ttl('rotate') (10m), the lease CALL
	// idem.rotate() takes too.
	LockTTL *time.Duration
	// MoveDefault moves the rows that landed in the default partition into
	// partitions of their months (idem.move_default_month), so that those
	// months get their partition and later claims stop landing there.
	// Default false: they stay until prune deletes them.
	MoveDefault bool
	// MaxMoveRows is the most rows of one month MoveDefault moves: the move
	// holds the default partition's lock as long as copying them takes.
	// A month with more is left as it is (Step "kept: ..."). nil:
	// DefaultMaxMoveRows (50,000; about half a second on this project's
	// 2-core machine); 1 to 100,000,000.
	MaxMoveRows *int64
	// Holder identifies this run in the lock table. Default host:pid:random.
	Holder string
	// Logger receives each step. Default: discard.
	Logger *slog.Logger
}

// ErrInvalidConfig is matched by Validate's errors.
var ErrInvalidConfig = maintcfg.ErrInvalidConfig

// ConfigError names the Config field Validate refused and why.
type ConfigError = maintcfg.Error

// Validate reports the first bad field of c as a *ConfigError.
func (c Config) Validate() error {
	bad := func(field, format string, a ...any) error { return maintcfg.Bad("rotate", field, format, a...) }
	switch {
	// Premake and LockTimeout are CALL idem.rotate()'s premake and
	// lock_wait: their bounds are the database's (CheckConfig), one rule
	// for both.
	case c.StatementTimeout != nil && (*c.StatementTimeout < 0 || *c.StatementTimeout > maintcfg.MaxTimeout ||
		(*c.StatementTimeout > 0 && *c.StatementTimeout < time.Millisecond)):
		return bad("StatementTimeout", "%s is out of range (0 for none, or 1ms to %s, PostgreSQL's limit)", *c.StatementTimeout, maintcfg.MaxTimeout)
	case c.Retries != nil && (*c.Retries < 0 || *c.Retries > 100):
		return bad("Retries", "%d is out of range (0 to 100)", *c.Retries)
	case c.Backoff != nil && *c.Backoff < 0:
		return bad("Backoff", "%s is negative", *c.Backoff)
	case c.MaxMoveRows != nil && (*c.MaxMoveRows < 1 || *c.MaxMoveRows > 100_000_000):
		return bad("MaxMoveRows", "%d is out of range (1 to 100000000)", *c.MaxMoveRows)
	case c.LockTTL != nil && (*c.LockTTL < time.Millisecond || *c.LockTTL > 24*time.Hour):
		return bad("LockTTL", "%s is out of range (1ms to 24h)", *c.LockTTL)
	}
	return nil
}

// settings is a validated Config with its defaults filled in.
type settings struct {
	premake                  int
	keepDetached             bool
	moveDefault              bool
	maxMoveRows              int64
	lockTimeout, stmtTimeout time.Duration
	retries                  int
	backoff, lockTTL         time.Duration
	holder                   string
	log                      *slog.Logger
	lock                     *maintlock.Lock // the held rotate lock, renewed before each step
}

func (c Config) settings() (settings, error) {
	if err := c.Validate(); err != nil {
		return settings{}, err
	}
	s := settings{
		premake:      maintcfg.Or(c.Premake, DefaultPremake),
		keepDetached: c.KeepDetached,
		moveDefault:  c.MoveDefault,
		maxMoveRows:  maintcfg.Or(c.MaxMoveRows, DefaultMaxMoveRows),
		lockTimeout:  maintcfg.Or(c.LockTimeout, DefaultLockTimeout),
		stmtTimeout:  maintcfg.Or(c.StatementTimeout, DefaultStatementTimeout),
		retries:      maintcfg.Or(c.Retries, DefaultRetries),
		backoff:      maintcfg.Or(c.Backoff, DefaultBackoff),
		lockTTL:      maintcfg.Or(c.LockTTL, 0), // 0: the database's default
		holder:       c.Holder,
		log:          cmp.Or(c.Logger, slog.New(slog.DiscardHandler)),
	}
	if s.holder == "" {
		s.holder = maintlock.NewHolderID()
	}
	return s, nil
}

// CheckConfig checks cfg against the database's bounds for CALL
// idem.rotate()'s arguments (idem.check_rotate_args), after Validate: a
// value out of range is a *ConfigError naming the field.
func CheckConfig(ctx context.Context, q *pgxdb.Queries, cfg Config) error {
	c, err := cfg.settings()
	if err != nil {
		return err
	}
	return c.check(ctx, q)
}

func (c settings) check(ctx context.Context, q *pgxdb.Queries) error {
	_, err := q.CheckRotateArgs(ctx, pgxdb.CheckRotateArgsParams{Premake: int32(min(c.premake, math.MaxInt32)), LockWaitMs: c.lockTimeout.Milliseconds()})
	if sqlstate.Of(err) != sqlstate.InvalidParameterValue {
		return err
	}
	// The database's range, with the value as it was given.
	msg := sqlstate.Message(err)
	rng := msg
	if i := strings.Index(msg, " is out of range"); i >= 0 {
		rng = msg[i:]
	}
	if strings.HasPrefix(msg, "premake") {
		return maintcfg.Bad("rotate", "Premake", "%d%s", c.premake, rng)
	}
	return maintcfg.Bad("rotate", "LockTimeout", "%s%s", c.lockTimeout, rng)
}

// Step is one thing rotation did or tried.
type Step struct {
	Action string // "drop", "move", "create" or "retire"
	Target string // month (move, create) or partition (retire)
	Result string // "moved N rows", "created", "dropped", "detached", "kept: ...", "gave up: ..."
}

// Result is the outcome of a rotation.
type Result struct {
	Skipped bool
	Holder  maintlock.Holder // with Skipped: who holds the lock
	Steps   []Step
	GaveUp  int // steps left for the next run after lock timeouts
}

// ErrLockLost: the rotate lock's lease ended mid-run and another holder
// took it (this process stalled past LockTTL); the run stopped before its
// next step, leaving the rest to the holder.
var ErrLockLost = errors.New("rotate: lost the rotate lock mid-run")

// ErrIncomplete is returned (with the Result) when some steps gave up
// after lock timeouts; the next run tries them again.
var ErrIncomplete = errors.New("rotation incomplete: some steps could not get their locks in time")

// Partition is one partition of processed_events.
type Partition = pgxdb.ListPartitionsRow

// List returns the partitions, months in order, the default one last.
func List(ctx context.Context, pool *pgxpool.Pool) ([]Partition, error) {
	return pgxdb.New(pool).ListPartitions(ctx)
}

// Rotate runs one rotation: the steps of CALL idem.rotate()
// (idem.try_lock, idem.months_to_create and idem.make_month,
// idem.partitions_to_retire and idem.retire_partition then
// idem.drop_detached, idem.release_lock), driven from Go with retries and
// logs.
func Rotate(ctx context.Context, pool *pgxpool.Pool, cfg Config) (*Result, error) {
	c, err := cfg.settings()
	if err != nil {
		return nil, err
	}
	started := time.Now()
	res, err := c.rotate(ctx, pool)
	if res == nil {
		return res, err
	}
	// The run as the dashboard shows it (idem.runs), with the figures of
	// CALL idem.rotate()'s record.
	figures := map[string]any{"created": 0, "retired": 0, "kept": 0, "gave_up": res.GaveUp}
	for _, s := range res.Steps {
		switch {
		case s.Action == "create" && s.Result == "created":
			figures["created"] = figures["created"].(int) + 1
		case s.Action == "retire" && (s.Result == "dropped" || s.Result == "detached"):
			figures["retired"] = figures["retired"].(int) + 1
		case s.Action == "retire" && strings.HasPrefix(s.Result, "kept"):
			figures["kept"] = figures["kept"].(int) + 1
		}
	}
	r := maintlock.Run{Job: LockName, Started: started, Outcome: "ok", Err: err, Holder: c.holder, Figures: figures}
	switch {
	case errors.Is(err, ErrIncomplete):
		r.Outcome, r.Err = "incomplete", nil
	case errors.Is(err, context.Canceled):
		// SIGTERM: the step in flight finished, the rest is the next run's.
		r.Outcome, r.Err = "interrupted", nil
	case err != nil:
		r.Outcome = "error"
	case res.Skipped:
		r.Outcome, r.Figures = "skipped", map[string]any{"holder": res.Holder.Holder}
	}
	maintlock.Record(ctx, pgxdb.New(pool), c.log, r)
	return res, err
}

func (c settings) rotate(ctx context.Context, pool *pgxpool.Pool) (*Result, error) {
	q := pgxdb.New(pool)
	if err := c.check(ctx, q); err != nil {
		return nil, err
	}
	lock := maintlock.New(q, LockName, c.holder, c.lockTTL)
	held, err := lock.Take(ctx, c.log)
	if err != nil {
		return nil, err
	}
	if !held.Acquired {
		return &Result{Skipped: true, Holder: held}, nil
	}
	defer lock.Release(ctx, c.log)

	res := &Result{}
	c.lock = lock
	// Months an earlier rotation detached to drop and did not drop (its
	// DROP gave up on a lock, or it was stopped between the two).
	detached, err := q.DetachedMonths(ctx)
	if err != nil {
		return res, fmt.Errorf("list detached months: %w", err)
	}
	for _, d := range detached {
		if !d.DropPending {
			continue
		}
		out, err := c.step(ctx, pool, func(ctx context.Context, q *pgxdb.Queries) (string, error) {
			return q.DropDetached(ctx, d.Name)
		})
		if err != nil {
			return res, fmt.Errorf("drop %s (detached by an earlier rotation): %w", d.Name, err)
		}
		res.add(ctx, c.log, Step{"drop", d.Name, out})
	}
	if c.moveDefault {
		if err := c.moveDefaultRows(ctx, pool, q, res); err != nil {
			return res, err
		}
	}
	months, err := q.MonthsToCreate(ctx, int32(c.premake))
	if err != nil {
		return res, fmt.Errorf("list months to create: %w", err)
	}
	for _, m := range months {
		month := m.Time.Format("2006-01")
		out, err := c.step(ctx, pool, func(ctx context.Context, q *pgxdb.Queries) (string, error) {
			return q.MakeMonth(ctx, m)
		})
		if err != nil {
			return res, fmt.Errorf("create the partition for %s: %w", month, err)
		}
		res.add(ctx, c.log, Step{"create", month, out})
	}

	parts, err := q.PartitionsToRetire(ctx)
	if err != nil {
		return res, fmt.Errorf("list partitions to retire: %w", err)
	}
	for _, name := range parts {
		// Detach first and drop in a second transaction: the lock on
		// processed_events, which claims queue behind, lasts only the detach.
		out, err := c.step(ctx, pool, func(ctx context.Context, q *pgxdb.Queries) (string, error) {
			out, err := q.RetirePartition(ctx, pgxdb.RetirePartitionParams{Name: name, KeepDetached: true})
			if err == nil && out == "detached" && !c.keepDetached {
				// The intent to drop is recorded with the detach: a drop
				// that does not happen below is the next run's to do.
				err = q.MarkForDrop(ctx, name)
			}
			return out, err
		})
		if err != nil {
			return res, fmt.Errorf("retire %s: %w", name, err)
		}
		if out == "detached" && !c.keepDetached {
			out, err = c.step(ctx, pool, func(ctx context.Context, q *pgxdb.Queries) (string, error) {
				return q.DropDetached(ctx, name)
			})
			if err != nil {
				return res, fmt.Errorf("drop %s: %w", name, err)
			}
		}
		res.add(ctx, c.log, Step{"retire", name, out})
	}
	if res.GaveUp > 0 {
		return res, ErrIncomplete
	}
	return res, nil
}

// moveDefaultRows moves each month's rows out of the default partition
// into a partition of that month, one short transaction per month, under
// rotation's lock (idem.default_months, idem.move_default_month).
func (c settings) moveDefaultRows(ctx context.Context, pool *pgxpool.Pool, q *pgxdb.Queries, res *Result) error {
	months, err := q.DefaultMonths(ctx)
	if err != nil {
		return fmt.Errorf("list the months in the default partition: %w", err)
	}
	for _, m := range months {
		month := m.Month.Time.Format("2006-01")
		if m.RowCount > c.maxMoveRows {
			res.add(ctx, c.log, Step{"move", month, fmt.Sprintf("kept: %d rows in the default partition, more than MaxMoveRows (%d); prune deletes them as they expire", m.RowCount, c.maxMoveRows)})
			continue
		}
		out, err := c.step(ctx, pool, func(ctx context.Context, q *pgxdb.Queries) (string, error) {
			n, err := q.MoveDefaultMonth(ctx, pgxdb.MoveDefaultMonthParams{Month: m.Month, MaxRows: c.maxMoveRows})
			return fmt.Sprintf("moved %d rows", n), err
		})
		var pg *pgconn.PgError
		if errors.As(err, &pg) && pg.Code == sqlstate.TooManyDefaultRows {
			// More arrived since they were counted: nothing was moved.
			out, err = "kept: "+pg.Message, nil
		}
		if err != nil {
			return fmt.Errorf("move %s's rows out of the default partition: %w", month, err)
		}
		res.add(ctx, c.log, Step{"move", month, out})
	}
	return nil
}

func (r *Result) add(ctx context.Context, log *slog.Logger, s Step) {
	r.Steps = append(r.Steps, s)
	if len(s.Result) >= 7 && s.Result[:7] == "gave up" {
		r.GaveUp++
	}
	log.LogAttrs(ctx, slog.LevelInfo, "rotate",
		slog.String("action", s.Action), slog.String("target", s.Target), slog.String("result", s.Result))
}

// step runs fn in a transaction with SET LOCAL lock_timeout, retrying with
// backoff when it times out on a lock. After the last try it reports
// "gave up: ..." instead of an error: the next run will try again.
//
// Before each try it renews the rotate lock, and stops with ErrLockLost
// when another holder has it (the lease ended: this process stalled past
// LockTTL): two rotations never run the same steps. A step is not
// cancelled with ctx (SIGTERM): it is short, bounded by LockTimeout and
// StatementTimeout, and runs to its end; the run stops before the next
// step. fn gets the step's context, which SIGTERM does not cancel, for its
// statements: with the run's ctx, as the steps had, SIGTERM cut the
// statement in flight (pgx closes the connection under it), so the server
// rolled the step back when it noticed (TestRotateSIGTERMFinishesTheStep).
func (c settings) step(ctx context.Context, pool *pgxpool.Pool, fn func(ctx context.Context, q *pgxdb.Queries) (string, error)) (string, error) {
	wait := c.backoff
	var leaseEnd time.Time // the rotate lock's, as last renewed
	for try := 0; ; try++ {
		if err := ctx.Err(); err != nil {
			return "", fmt.Errorf("rotation stopped before its next step: %w", err)
		}
		if c.lock != nil {
			held, err := c.lock.Acquire(context.WithoutCancel(ctx))
			leaseEnd = held.ExpiresAt
			if err != nil {
				return "", err
			}
			if !held.Acquired {
				return "", fmt.Errorf("%w (now held by %s until %s)", ErrLockLost, held.Holder, held.ExpiresAt.UTC().Format(time.RFC3339))
			}
		}
		out, err := c.tx(context.WithoutCancel(ctx), pool, fn)
		if err == nil {
			return out, nil
		}
		if !isLockTimeout(err) {
			return "", err
		}
		if try >= c.retries {
			return fmt.Sprintf("gave up: locks not available within %s after %d tries", c.lockTimeout, try+1), nil
		}
		c.log.LogAttrs(ctx, slog.LevelWarn, "rotate step timed out on a lock; retrying",
			slog.Int("try", try+1), slog.Duration("backoff", wait))
		pause := time.Duration(float64(wait) * (0.5 + rand.Float64()))
		if !leaseEnd.IsZero() {
			// Never sleep the lease away between two renewals: a doubled
			// backoff grows past any lease.
			pause = min(pause, time.Until(leaseEnd)/2)
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", ctx.Err()
		case <-t.C:
		}
		wait *= 2
	}
}

func (c settings) tx(ctx context.Context, pool *pgxpool.Pool, fn func(ctx context.Context, q *pgxdb.Queries) (string, error)) (string, error) {
	var out string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := dbutil.SetLocalTimeouts(ctx, tx, c.lockTimeout, c.stmtTimeout); err != nil {
			return err
		}
		var err error
		out, err = fn(ctx, pgxdb.New(tx))
		return err
	})
	return out, err
}

func isLockTimeout(err error) bool { return sqlstate.Of(err) == sqlstate.LockNotAvailable }
