package migrate

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math"
	"slices"
	"strings"
	"testing/fstest"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"

	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/sql/migrations"
)

// Each migration step is one transaction, and its first statements (added
// to the embedded migration's text as goose reads it, see guardedFS) make
// it safe to run while the application runs and through a transaction
// pooler:
//
//  0. search_path = pg_catalog, pg_temp for the step's transaction: a
//     migration's own statements (a DO block, a top-level SELECT) cannot
//     meet a look-alike operator or function another role planted in a
//     schema on the migrator's path (docs/security.md).
//  1. The transaction advisory lock LockID (LockStatement): one step of
//     idem's at a time. The lock belongs to the step's transaction, so it
//     holds through PgBouncer in transaction mode (a session lock would be
//     taken and released on different server sessions there) and it is
//     never left behind: it ends with the transaction, committed, rolled
//     back or cut off. Any login may take an advisory lock, so the wait is
//     bounded (LockWait), then refused with ErrLocked.
//  2. The step checks that its version is still to be applied (up) or
//     still applied (down), and raises stepDoneElsewhere when another
//     migrator did it while this one waited for the lock; Migrator looks
//     again and goes on from there.
//  3. lock_timeout for the rest of the step (Config.LockTimeout): a step
//     that needs a table lock an application transaction holds waits that
//     long, not for the whole of that transaction, so claims do not queue
//     behind the step's lock request. The step then rolls back and
//     Migrator retries it after a pause (Config.Retries times).
//  4. Where Citus is installed, citus.multi_shard_modify_mode = sequential
//     for the step (see prologue).

// LockWait is how long a migration step (idem's or River's) waits for its
// migration lock: another migrator's step, or a session of any role that
// holds the same advisory lock id.
const LockWait = 10 * time.Minute

// ErrLocked: the migration lock was held for LockWait (SQLSTATE IDM02).
var ErrLocked = errors.New("idem/migrate: the migration lock is held")

// LockStatement is the statement that takes the transaction advisory lock
// id for a migration step, waiting at most LockWait (polling: a blocking
// wait would wait as long as any session holds it), then raising IDM02.
func LockStatement(id int64) string {
	tries := int(LockWait / (200 * time.Millisecond))
	return fmt.Sprintf(`DO $idem$ BEGIN FOR i IN 1..%d LOOP IF pg_catalog.pg_try_advisory_xact_lock(%d::bigint) THEN RETURN; END IF; PERFORM pg_catalog.pg_sleep(0.2::double precision); END LOOP; `+
		`RAISE EXCEPTION 'the migration lock (advisory lock %d) was held for %s: another migrator, or a session of any role holding pg_advisory_lock(%d)' USING ERRCODE = '%s', `+
		`HINT = 'SELECT pid, usename, state FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a USING (pid) WHERE l.locktype = ''advisory'' names its holder; end that session, then migrate again.'; END $idem$;`,
		tries, id, id, LockWait, id, sqlstate.MigrationLocked)
}

// stepDoneElsewhere is raised by a step whose version another migrator
// applied (or rolled back) while this one waited for the migration lock.
const stepDoneElsewhere = sqlstate.MigrationStepDone

// Defaults of Config.
const (
	DefaultLockTimeout = 2 * time.Second
	DefaultRetries     = 30
)

// Config says how each migration step waits for locks.
type Config struct {
	// LockTimeout bounds how long a statement of a step waits for a table
	// lock (lock_timeout, set for the step's transaction only). An
	// application transaction holding a lock the step needs then delays
	// the application's other statements by at most about this long.
	// 0: DefaultLockTimeout. At least 1ms.
	LockTimeout time.Duration
	// Retries is how many times in all a step that timed out waiting for a
	// lock is tried again (after a pause that grows from 100ms to 5s)
	// before the migration gives up with ErrLockTimeout. 0: DefaultRetries;
	// -1: none.
	Retries int
	// Logger receives goose's log and one line per retry; nil: none.
	Logger *slog.Logger

	stepProbe stepProbe // tests only
}

// stepProbe is called at the end of each step, in its transaction, with
// the step's version and direction (tests only: it sees what the step
// holds; probeRows).
type stepProbe func(ctx context.Context, tx database.DBTxConn, version int64, up bool) error

// ErrLockTimeout: a step kept timing out waiting for a table lock held by
// another transaction, Config.Retries times. Nothing of that step was
// applied; the steps before it were.
var ErrLockTimeout = errors.New("idem/migrate: a migration step kept timing out waiting for a table lock")

func (c Config) withDefaults() (Config, error) {
	switch {
	case c.LockTimeout == 0:
		c.LockTimeout = DefaultLockTimeout
	case c.LockTimeout < time.Millisecond:
		return c, fmt.Errorf("idem/migrate: LockTimeout %v: give at least 1ms (0: the default, %v)", c.LockTimeout, DefaultLockTimeout)
	}
	switch {
	case c.Retries == 0:
		c.Retries = DefaultRetries
	case c.Retries == -1:
		c.Retries = 0
	case c.Retries < -1:
		return c, fmt.Errorf("idem/migrate: Retries %d: give 0 or more (-1: none)", c.Retries)
	}
	if c.Logger == nil {
		c.Logger = discardLogger
	}
	return c, nil
}

// Migrator applies idem's migrations with Config's lock bounds, retrying a
// step that timed out on a lock and going on after a step another
// migrator applied.
type Migrator struct {
	p      *goose.Provider
	db     *sql.DB
	cfg    Config
	online map[onlineKey][]onlineIndex // the indexes built before a step (online.go)
}

// New returns a Migrator over db (extra goose options are appended to
// idem's, as NewProvider's).
func New(db *sql.DB, cfg Config, opts ...goose.ProviderOption) (*Migrator, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	p, online, err := newProvider(db, cfg, append([]goose.ProviderOption{goose.WithSlog(cfg.Logger)}, opts...)...)
	if err != nil {
		return nil, err
	}
	return &Migrator{p: p, db: db, cfg: cfg, online: online}, nil
}

// Provider is the goose Provider the Migrator runs (for Status and
// GetDBVersion; its Up and Down run the same guarded steps, without the
// retries).
func (m *Migrator) Provider() *goose.Provider { return m.p }

// UpTo applies every pending migration up to version (math.MaxInt64: all),
// after CheckSchema: a schema idem owned or writable by another role is
// refused. Before a step that creates an index on idem.processed_events it
// builds that index on each partition concurrently (online.go).
func (m *Migrator) UpTo(ctx context.Context, version int64) ([]*goose.MigrationResult, error) {
	if err := CheckSchema(ctx, m.db); err != nil {
		return nil, err
	}
	var all []*goose.MigrationResult
	for _, k := range m.onlineSteps(true) {
		if k.version > version {
			break
		}
		if k.version > 1 {
			res, err := m.run(ctx, func() ([]*goose.MigrationResult, error) { return m.p.UpTo(ctx, k.version-1) })
			all = append(all, res...)
			if err != nil && !errors.Is(err, goose.ErrNoNextVersion) {
				return all, err
			}
		}
		if err := m.buildOnline(ctx, k, m.online[k]); err != nil {
			return all, err
		}
	}
	res, err := m.run(ctx, func() ([]*goose.MigrationResult, error) { return m.p.UpTo(ctx, version) })
	return append(all, res...), err
}

// onlineSteps lists the steps that create an index on idem.processed_events
// in direction up (or down), in the order they are applied.
func (m *Migrator) onlineSteps(up bool) []onlineKey {
	var keys []onlineKey
	for k := range m.online {
		if k.up == up {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b onlineKey) int {
		if up {
			return cmp.Compare(a.version, b.version)
		}
		return cmp.Compare(b.version, a.version)
	})
	return keys
}

// Up applies every pending migration.
func (m *Migrator) Up(ctx context.Context) ([]*goose.MigrationResult, error) {
	return m.UpTo(ctx, math.MaxInt64)
}

// DownTo rolls back to version, after GuardDown: a down that would drop
// stored state is refused unless force is set.
func (m *Migrator) DownTo(ctx context.Context, version int64, force bool) ([]*goose.MigrationResult, error) {
	if err := GuardDown(ctx, m.db, m.p, version, force); err != nil {
		return nil, err
	}
	var all []*goose.MigrationResult
	for _, k := range m.onlineSteps(false) {
		if k.version <= version {
			break
		}
		// Roll back the steps after k, build what k's Down creates, then
		// go on.
		res, err := m.run(ctx, func() ([]*goose.MigrationResult, error) { return m.p.DownTo(ctx, k.version) })
		all = append(all, res...)
		if err != nil && !errors.Is(err, goose.ErrNoNextVersion) {
			return all, err
		}
		if err := m.buildOnline(ctx, k, m.online[k]); err != nil {
			return all, err
		}
	}
	res, err := m.run(ctx, func() ([]*goose.MigrationResult, error) { return m.p.DownTo(ctx, version) })
	return append(all, res...), err
}

// run calls step until it succeeds, retrying after a lock timeout (up to
// Config.Retries times in all) and at once after a step another migrator
// did, and returns every step's result.
func (m *Migrator) run(ctx context.Context, step func() ([]*goose.MigrationResult, error)) ([]*goose.MigrationResult, error) {
	var all []*goose.MigrationResult
	timeouts, elsewhere := 0, 0
	for {
		res, err := step()
		all = append(all, res...)
		var partial *goose.PartialError
		if errors.As(err, &partial) {
			all = append(all, partial.Applied...)
		}
		if err == nil || errors.Is(err, goose.ErrNoNextVersion) {
			return all, err
		}
		switch sqlstate.Of(err) {
		case sqlstate.MigrationLocked:
			return all, fmt.Errorf("%w: %w", ErrLocked, err)
		case stepDoneElsewhere:
			// Each time, another migrator made progress; more times than
			// there are steps would mean the version table and goose
			// disagree.
			if elsewhere++; elsewhere > 2*int(Latest())+2 {
				return all, fmt.Errorf("idem/migrate: a step kept finding its version done by another migrator (%d times): %w", elsewhere, err)
			}
			m.cfg.Logger.InfoContext(ctx, "idem/migrate: another migrator did this step; looking again", slog.String("error", err.Error()))
			continue
		case sqlstate.LockNotAvailable:
			if timeouts >= m.cfg.Retries {
				return all, fmt.Errorf("%w (%d times, lock timeout %v): %w; an application transaction holds a lock the step needs: "+
					"migrate again when it has ended, or with a longer lock timeout or more retries (idemctl migrate up --lock-timeout, --lock-retries; migrate.Config)", ErrLockTimeout, timeouts+1, m.cfg.LockTimeout, err)
			}
			timeouts++
			pause := min(100*time.Millisecond<<min(timeouts-1, 6), 5*time.Second)
			m.cfg.Logger.WarnContext(ctx, "idem/migrate: a step timed out waiting for a table lock; retrying",
				slog.Int("retry", timeouts), slog.Int("of", m.cfg.Retries), slog.Duration("pause", pause), slog.String("error", err.Error()))
			select {
			case <-ctx.Done():
				return all, ctx.Err()
			case <-time.After(pause):
			}
			continue
		}
		return all, err
	}
}

// guardedFS returns the embedded migrations with the statements described
// at the top of this file added at the start of each Up and Down section,
// and the indexes on idem.processed_events each section creates, which the
// Migrator builds online before the step (online.go). probe adds the
// statement of stepProbe (tests only).
func guardedFS(lockTimeout time.Duration, probe bool) (fs.FS, map[onlineKey][]onlineIndex, error) {
	entries, err := fs.ReadDir(migrations.FS, ".")
	if err != nil {
		return nil, nil, err
	}
	out := fstest.MapFS{} // an in-memory fs.FS; nothing of testing is used
	online := map[onlineKey][]onlineIndex{}
	for _, e := range entries {
		b, err := fs.ReadFile(migrations.FS, e.Name())
		if err != nil {
			return nil, nil, err
		}
		if !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		version, err := goose.NumericComponent(e.Name())
		if err != nil {
			return nil, nil, fmt.Errorf("idem/migrate: %s: %w", e.Name(), err)
		}
		text := string(b)
		if strings.Contains(text, "-- +goose NO TRANSACTION") {
			return nil, nil, fmt.Errorf("idem/migrate: %s runs outside a transaction (NO TRANSACTION): each of idem's steps must be one, "+
				"since the migration lock and the lock timeout are the transaction's", e.Name())
		}
		for _, dir := range []string{"Up", "Down"} {
			marker := "-- +goose " + dir + "\n"
			if strings.Count(text, marker) != 1 {
				return nil, nil, fmt.Errorf("idem/migrate: %s has %d %q lines, want one", e.Name(), strings.Count(text, marker), strings.TrimSpace(marker))
			}
		}
		_, rest, _ := strings.Cut(text, "-- +goose Up\n")
		up, down, found := strings.Cut(rest, "-- +goose Down\n")
		if !found {
			return nil, nil, fmt.Errorf("idem/migrate: %s: its Down section comes before its Up section", e.Name())
		}
		for _, s := range []struct {
			text string
			up   bool
		}{{up, true}, {down, false}} {
			ix, err := onlineIndexes(e.Name(), s.text)
			if err != nil {
				return nil, nil, err
			}
			if len(ix) > 0 {
				online[onlineKey{version, s.up}] = ix
			}
		}
		for _, dir := range []string{"Up", "Down"} {
			marker := "-- +goose " + dir + "\n"
			text = strings.Replace(text, marker, marker+prologue(version, dir == "Up", lockTimeout, probe), 1)
		}
		out[e.Name()] = &fstest.MapFile{Data: []byte(text)}
	}
	return out, online, nil
}

// prologue is the statements each step starts with (one per line, as
// goose splits them). Where Citus is installed, the step's DDL on
// distributed tables runs one connection per node
// (citus.multi_shard_modify_mode): Citus refuses a function's DDL after a
// parallel operation on a distributed table in one transaction, and a step
// that alters a distributed table and then delegates its functions again
// (idem.citus_setup, migration 17 on an installation distributed at 13)
// failed with "cannot run function command because there was a parallel
// operation on a distributed table in the transaction".
func prologue(version int64, up bool, lockTimeout time.Duration, probe bool) string {
	cond, did := "", "applied"
	if !up {
		cond, did = "NOT ", "rolled back"
	}
	s := fmt.Sprintf(`SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true);
%s
DO $idem$ BEGIN IF %sEXISTS (SELECT FROM %s WHERE version_id = %d AND is_applied) THEN RAISE EXCEPTION 'idem migration %d was %s by another migrator' USING ERRCODE = '%s'; END IF; END $idem$;
SELECT pg_catalog.set_config('lock_timeout', '%dms', true);
SELECT pg_catalog.set_config('citus.multi_shard_modify_mode', 'sequential', true) WHERE pg_catalog.to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL;
`, LockStatement(LockID), cond, TableName, version, version, did, stepDoneElsewhere, lockTimeout.Milliseconds())
	if probe {
		s += "SELECT pg_catalog.set_config('idem.probe_rows', (" + probeRows + "), true);\n"
	}
	return s
}

// probeRows counts the rows of idem.processed_events and its partitions
// this backend has read (first) and written (second), as "read written",
// and not yet reported to the cumulative statistics. Reporting happens only
// outside a transaction, so the growth between a step's start (prologue)
// and its end (stepProbe) is what the step read or wrote, by any means: a
// heap scan (an index build, a constraint's validation, a rewrite), an
// index fetch, an insert, update or delete. Tests only (Config.stepProbe).
const probeRows = `SELECT coalesce(pg_catalog.sum(pg_catalog.pg_stat_get_xact_tuples_returned(r.relid) OPERATOR(pg_catalog.+) pg_catalog.pg_stat_get_xact_tuples_fetched(r.relid)), 0)::text
	OPERATOR(pg_catalog.||) ' ' OPERATOR(pg_catalog.||)
	coalesce(pg_catalog.sum(pg_catalog.pg_stat_get_xact_tuples_inserted(r.relid) OPERATOR(pg_catalog.+) pg_catalog.pg_stat_get_xact_tuples_updated(r.relid) OPERATOR(pg_catalog.+)
	pg_catalog.pg_stat_get_xact_tuples_deleted(r.relid)), 0)::text
	FROM pg_catalog.pg_partition_tree(pg_catalog.to_regclass('idem.processed_events')) r`
