package migrate_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/internal/upgradeload"
	"github.com/idemkit/idem/migrate"
)

// Tried as a team deploying would: a rolling deploy whose migration runs
// while the application claims, two deploys racing through a transaction
// pooler, a down across versions that hold state.

// TestUpgradeUnderClaimLoad: every upgrade path (from each version to the
// latest) is applied to a database holding IDEM_UPGRADE_KEYS stored keys
// (default 20,000; bench scale 1,000,000 or more) while 8 clients claim
// (new keys and duplicates of stored ones) next to an application
// transaction that holds a claim open for hold. A step that needs a table
// lock the application transaction holds waits at most its lock timeout,
// rolls back and is retried, so claims do not queue behind its lock request
// for the whole of the application transaction; an index on
// idem.processed_events is built concurrently before its step
// (migrate/online.go), so no claim waits for a build. Reported per path:
// the longest claim (wall time, logged only) and the longest a claim was
// seen waiting on a lock the migration held or was queued for (pg_locks'
// waitstart, the server's clock), which is checked (blockedByMigration:
// under half of hold; with no lock timeout, as before, a claim queued
// behind the step for the rest of the application transaction: 1.9s of a
// 2s hold from versions 5 and 7; with migration 19's plain CREATE INDEX,
// for the whole build). The wall time of a claim is not checked: on a
// loaded machine it is mostly the wait for a CPU (a claim took 1.5 s from
// version 17 under load 20 on CI; here, from 5, 7 and 17 at load 18, the
// longest claims took 435-912 ms while their waits on the migration were
// at most 103 ms, as at load 10 with claims of 330-380 ms), which says
// nothing about the migration; a wait on its locks is what
// blocking is, and TestUpgradeLoadSeesBlocking proves the check fails a
// step that blocks claims. The one path where claims fail is the step of
// migration 4 (see below).
func TestUpgradeUnderClaimLoad(t *testing.T) {
	const (
		clients     = 8
		hold        = 3 * time.Second
		lockTimeout = 100 * time.Millisecond
	)
	keys := 20_000
	if s := os.Getenv("IDEM_UPGRADE_KEYS"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1000 {
			t.Fatalf("IDEM_UPGRADE_KEYS=%q: want a number of keys, at least 1000", s)
		}
		keys = n
	}
	for from := int64(1); from < migrate.Latest(); from++ {
		t.Run(fmt.Sprintf("from %d", from), func(t *testing.T) {
			ctx := context.Background()
			url := testdb.NewEmpty(t)
			pool := testdb.Pool(t, url, clients+3)
			db, err := sql.Open("pgx", upgradeload.MigratorURL(url))
			if err != nil {
				t.Fatal(err)
			}
			defer db.Close()
			p, err := migrate.NewProvider(db)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.UpTo(ctx, from); err != nil {
				t.Fatal(err)
			}
			if err := upgradeload.Seed(ctx, pool, keys); err != nil {
				t.Fatal(err)
			}

			// The application's transaction: a claim, held open.
			app, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := app.Exec(ctx, `SELECT idem.claim('app', 'held')`); err != nil {
				t.Fatal(err)
			}
			load, err := upgradeload.Start(ctx, pool, clients)
			if err != nil {
				t.Fatal(err)
			}
			var commitOnce sync.Once
			commit := func() { commitOnce.Do(func() { _ = app.Commit(ctx) }) }
			timer := time.AfterFunc(hold, commit)
			m, err := migrate.New(db, migrate.Config{LockTimeout: lockTimeout})
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			res, err := m.Up(ctx)
			took := time.Since(start)
			timer.Stop()
			commit()
			seen, monErr := load.Stop()
			if err != nil {
				t.Fatalf("migrate up from %d under load: %v", from, err)
			}
			if monErr != nil {
				t.Fatalf("the lock monitor: %v", monErr)
			}
			dropped := 0
			for _, err := range seen.Errs {
				// Migration 4 changes idem.claim's arguments: it drops the
				// old function and creates the new one, and a call that
				// looked the old one up just before the step committed
				// fails (PostgreSQL takes no lock on a function it calls).
				// Shipped migrations are not edited; later ones replace
				// claim with CREATE OR REPLACE, which keeps it callable.
				if c := sqlstate.Of(err); from < 4 && (c == "XX000" && strings.Contains(err.Error(), "cache lookup failed for function") || c == sqlstate.UndefinedFunction) {
					dropped++
					continue
				}
				t.Errorf("a claim failed while the migration ran: %v", err)
			}
			if dropped > 0 {
				t.Logf("from %d: %d claims failed as migration 4 dropped idem.claim's old signature", from, dropped)
			}
			if v, err := p.GetDBVersion(ctx); err != nil || v != migrate.Latest() {
				t.Fatalf("after the upgrade: version %d (%v)", v, err)
			}
			t.Logf("from %d with %d keys: %d steps in %v next to a %v application transaction; %d claims, the longest %v; the longest wait on the migration's locks %v (%s)",
				from, keys, len(res), took.Round(time.Millisecond), hold, seen.Claims, seen.Longest.Round(time.Millisecond),
				seen.LongestWait.Round(time.Millisecond), seen.WaitedOn)
			if err := blockedByMigration(seen, hold); err != nil {
				t.Errorf("from %d: %v", from, err)
			}
		})
	}
}

// blockedByMigration is TestUpgradeUnderClaimLoad's verdict on what its
// load saw: claims blocked behind the migration, by lock waits (pg_locks),
// not wall time. A claim seen waiting on a lock a migrating backend held
// or was queued for ahead of it, for half of hold or more, was blocked by
// the migration: by a step that queued behind the application transaction
// (hold) without giving way at its lock timeout, or by a step that held a
// lock claims need for that long. Without those, a claim's waits behind the
// migration last about the migration's lock timeout (100 ms).
func blockedByMigration(seen upgradeload.Result, hold time.Duration) error {
	if seen.LongestWait >= hold/2 {
		return fmt.Errorf("a claim waited %v on a lock the migration held or asked for (claims blocked behind it; the longest claim took %v), running %s",
			seen.LongestWait, seen.Longest, seen.WaitedOn)
	}
	return nil
}

// TestUpgradeLoadSeesBlocking: the negative controls of
// TestUpgradeUnderClaimLoad's check. Under the same load (8 clients
// claiming new and stored keys), a "step" on a migrating connection
// (application_name upgradeload.MigratorApp) that blocks claims makes
// blockedByMigration fail: one that takes ACCESS EXCLUSIVE on
// idem.processed_events and holds it for hold, and one that asks for it,
// with no lock timeout, behind an application transaction holding a claim
// open for hold (what migrations did before they had a lock timeout).
func TestUpgradeLoadSeesBlocking(t *testing.T) {
	t.Parallel()
	const (
		clients = 8
		hold    = 3 * time.Second
	)
	for _, tc := range []struct {
		name  string
		appTx bool // an application transaction holds a claim open for hold
		step  string
	}{
		{"a step holding ACCESS EXCLUSIVE", false,
			`BEGIN; LOCK TABLE idem.processed_events IN ACCESS EXCLUSIVE MODE; SELECT pg_catalog.pg_sleep(3); COMMIT`},
		{"a step queued behind the application transaction", true,
			`BEGIN; SET LOCAL lock_timeout = 0; LOCK TABLE idem.processed_events IN ACCESS EXCLUSIVE MODE; COMMIT`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url := testdb.New(t)
			pool := testdb.Pool(t, url, clients+3)
			if err := upgradeload.Seed(ctx, pool, 2000); err != nil {
				t.Fatal(err)
			}
			migrator, err := sql.Open("pgx", upgradeload.MigratorURL(url))
			if err != nil {
				t.Fatal(err)
			}
			defer migrator.Close()
			var app pgx.Tx
			if tc.appTx {
				if app, err = pool.Begin(ctx); err != nil {
					t.Fatal(err)
				}
				defer app.Rollback(ctx)
				if _, err := app.Exec(ctx, `SELECT idem.claim('app', 'held')`); err != nil {
					t.Fatal(err)
				}
			}
			load, err := upgradeload.Start(ctx, pool, clients)
			if err != nil {
				t.Fatal(err)
			}
			if app != nil {
				timer := time.AfterFunc(hold, func() { _ = app.Commit(ctx) })
				defer timer.Stop()
			}
			_, stepErr := migrator.ExecContext(ctx, tc.step)
			seen, monErr := load.Stop()
			if stepErr != nil || monErr != nil {
				t.Fatalf("the step: %v; the lock monitor: %v", stepErr, monErr)
			}
			for _, err := range seen.Errs {
				t.Errorf("a claim failed: %v", err)
			}
			err = blockedByMigration(seen, hold)
			if err == nil {
				t.Fatalf("%s: claims not seen blocked (%d claims, the longest %v, the longest wait on the step's lock %v)",
					tc.name, seen.Claims, seen.Longest, seen.LongestWait)
			}
			t.Logf("%s: %v", tc.name, err)
		})
	}
}

// TestRacingMigrateUpThroughPgBouncer: two migrate up at once, both through
// PgBouncer in transaction pooling mode, from nothing and again from
// version 7: each step is applied by exactly one of them, neither fails,
// the version table holds each version once, no advisory lock is left on
// any server session, and a direct migrate up afterwards finds nothing to
// do at once.
func TestRacingMigrateUpThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	direct, _ := setup(t)
	var name string
	if err := direct.QueryRowContext(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	// database/sql over pgx's stdlib through PgBouncer 1.18 wants pgx's
	// exec mode (docs/idemctl.md, PgBouncer); idemctl sets it itself.
	bouncer := testdb.PgBouncer(t, name) + testdb.ExecMode
	open := func() *sql.DB {
		db, err := sql.Open("pgx", bouncer)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		return db
	}
	a, b := open(), open()
	for _, from := range []int64{0, 7} {
		if from > 0 {
			if _, err := migrate.DownTo(ctx, direct, from, true); err != nil {
				t.Fatal(err)
			}
		}
		var (
			wg      sync.WaitGroup
			results [2][]*goose.MigrationResult
			errs    [2]error
		)
		for i, db := range []*sql.DB{a, b} {
			wg.Go(func() { results[i], errs[i] = migrate.Up(ctx, db) })
		}
		wg.Wait()
		var versions []int64
		for i := range results {
			if errs[i] != nil {
				t.Fatalf("from %d: migrator %d failed: %v", from, i, errs[i])
			}
			for _, r := range results[i] {
				versions = append(versions, r.Source.Version)
			}
		}
		slices.Sort(versions)
		// Every version after from, as shipped: the numbers may have gaps
		// (a branch's migration numbered ahead of another's).
		var want []int64
		sp, err := migrate.NewProvider(direct)
		if err != nil {
			t.Fatal(err)
		}
		for _, src := range sp.ListSources() {
			if src.Version > from {
				want = append(want, src.Version)
			}
		}
		if !slices.Equal(versions, want) {
			t.Fatalf("from %d: the two migrators applied %v (first %d, second %d steps), want each of %v once",
				from, versions, len(results[0]), len(results[1]), want)
		}
		t.Logf("from %d: one migrator applied %d steps, the other %d", from, len(results[0]), len(results[1]))
		var rows, distinct int64
		if err := direct.QueryRowContext(ctx, `SELECT count(*), count(DISTINCT version_id) FROM idem.goose_db_version WHERE version_id > 0`).Scan(&rows, &distinct); err != nil {
			t.Fatal(err)
		}
		if shipped := int64(len(sp.ListSources())); rows != shipped || distinct != rows {
			t.Fatalf("from %d: the version table holds %d rows of %d versions, want %d", from, rows, distinct, shipped)
		}
		var locks int
		if err := direct.QueryRowContext(ctx, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND classid = 0 AND objid = $1 AND objsubid = 1`,
			migrate.LockID).Scan(&locks); err != nil {
			t.Fatal(err)
		}
		if locks != 0 {
			t.Fatalf("from %d: %d migration locks left on server sessions", from, locks)
		}
		quick, cancel := context.WithTimeout(ctx, 30*time.Second)
		res, err := migrate.Up(quick, direct)
		cancel()
		if err != nil || len(res) != 0 {
			t.Fatalf("from %d: a direct migrate up after the race: %d steps, %v", from, len(res), err)
		}
	}
}

// TestDownStatesWhatItDrops: a down across versions whose Down drops
// stored state is refused, listing each table and column with what it
// holds (the inbox's holds, an adoption in progress, a policy's setting,
// the maintenance runs' history), and nothing is dropped; with force it
// goes ahead. A down across versions holding nothing is not refused.
func TestDownStatesWhatItDrops(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.DownTo(ctx, db, 9, false); err != nil {
		t.Fatalf("down to 9 with nothing stored past 9: %v", err)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	state := []struct{ object, sql string }{
		{"idem.holds: 1 rows (dropped by migration 7's Down)", `INSERT INTO idem.holds (source, key, token, held_at) VALUES ('s', 'k', 1, now())`},
		{"idem.adoptions: 1 rows (dropped by migration 9's Down)", `CREATE TABLE public.legacy (k text, at timestamptz);
		  INSERT INTO idem.adoptions (source, legacy, key_column, at_column, ttl) VALUES ('s', 'public.legacy', 'k', 'at', '1 day')`},
		{"idem.policies.count_per_key: set on 1 rows (dropped by migration 5's Down)", `INSERT INTO idem.policies (source, ttl, lease, max_attempts, count_per_key) VALUES ('counted', '1 day', '1 minute', 3, true)`},
		{"idem.runs: 1 rows (dropped by migration 10's Down)", `INSERT INTO idem.runs (job, started_at, finished_at, outcome, run_by) VALUES ('prune', now(), now(), 'ok', 'me')`},
	}
	for _, s := range state {
		if _, err := db.ExecContext(ctx, s.sql); err != nil {
			t.Fatalf("store %s: %v", s.object, err)
		}
	}
	_, err := migrate.DownTo(ctx, db, 4, false)
	if !errors.Is(err, migrate.ErrWouldLoseState) {
		t.Fatalf("down to 4 holding state: %v, want ErrWouldLoseState", err)
	}
	for _, s := range state {
		if !strings.Contains(err.Error(), s.object) {
			t.Errorf("the refusal does not state %q:\n%v", s.object, err)
		}
	}
	if !strings.Contains(err.Error(), "--force") {
		t.Errorf("the refusal does not say how to go ahead: %v", err)
	}
	t.Logf("the refusal: %v", err)
	losses, err := migrate.Losses(ctx, db, migrate.Latest(), 4)
	if err != nil {
		t.Fatal(err)
	}
	var objects []string
	for _, l := range losses {
		objects = append(objects, l.Object)
	}
	sort.Strings(objects)
	if want := []string{"idem.adoptions", "idem.holds", "idem.policies.count_per_key", "idem.runs"}; !slices.Equal(objects, want) {
		t.Errorf("Losses down to 4: %v, want %v", objects, want)
	}
	var v int64
	if err := db.QueryRowContext(ctx, `SELECT max(version_id) FROM idem.goose_db_version`).Scan(&v); err != nil || v != migrate.Latest() {
		t.Fatalf("after the refusal: version %d (%v), want %d: nothing rolled back", v, err, migrate.Latest())
	}
	if _, err := migrate.DownTo(ctx, db, 4, true); err != nil {
		t.Fatalf("down to 4 with force: %v", err)
	}
}

// TestUpGivesUpWithErrLockTimeout: while an application transaction that
// claimed a key stays open, the step that needs a lock it holds gives way
// each time; after Config.Retries retries the migration stops with
// ErrLockTimeout, saying what to do, the steps before it applied and
// nothing of that step. Once the transaction ends, migrate up finishes.
func TestUpGivesUpWithErrLockTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	pool := testdb.Pool(t, url, 4)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 4); err != nil {
		t.Fatal(err)
	}
	app, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer app.Rollback(ctx)
	if _, err := app.Exec(ctx, `SELECT idem.claim('app', 'held')`); err != nil {
		t.Fatal(err)
	}
	m, err := migrate.New(db, migrate.Config{LockTimeout: 20 * time.Millisecond, Retries: 2})
	if err != nil {
		t.Fatal(err)
	}
	res, upErr := m.Up(ctx)
	if !errors.Is(upErr, migrate.ErrLockTimeout) {
		t.Fatalf("up next to an open claim transaction: %d steps, %v; want ErrLockTimeout", len(res), upErr)
	}
	for _, want := range []string{"3 times", "--lock-timeout", "--lock-retries", "55P03"} {
		if !strings.Contains(upErr.Error(), want) {
			t.Errorf("the error does not say %q: %v", want, upErr)
		}
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil || v != 4+int64(len(res)) {
		t.Fatalf("after giving up: version %d (%v), %d steps reported applied", v, err, len(res))
	}
	t.Logf("gave up at version %d: %v", v, upErr)
	if err := app.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("up once the transaction ended: %v", err)
	}
	if _, err := migrate.New(db, migrate.Config{LockTimeout: time.Microsecond}); err == nil {
		t.Error("a lock timeout under 1ms was accepted")
	}
	if _, err := migrate.New(db, migrate.Config{Retries: -2}); err == nil {
		t.Error("Retries -2 was accepted")
	}
}
