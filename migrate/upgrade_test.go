package migrate_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestUpgradeTo4: an installation at version 3 holding keys in several
// months (completed, failed, leased, and one claimed through version 3's
// idem.claim) and an application role is upgraded to version 4: every old
// key answers as before, the leased one completes with its old token, the
// role keeps its rights on the new claim; down to 3 and up again keeps it all.
func TestUpgradeTo4(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	role := fmt.Sprintf("idem_upgrade_app_%d", time.Now().UnixNano())
	if _, err := db.ExecContext(ctx, `CREATE ROLE `+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), `DROP OWNED BY `+role)
		_, _ = db.ExecContext(context.Background(), `DROP ROLE `+role)
	})
	now := time.Now().UTC()
	month := func(add int) time.Time { return testdb.MonthStart(now, add) }
	var leasedToken int64
	if _, err := db.ExecContext(ctx, `SELECT idem.grant_app($1::regrole)`, role); err != nil {
		t.Fatal(err)
	}
	for _, m := range []time.Time{month(-2), month(-1)} {
		if _, err := db.ExecContext(ctx, `SELECT idem.create_partition($1::date)`, m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, result, last_error, retryable, first_seen, updated_at, expires_at)
		VALUES ('up', 'done-2', $1::date, 'completed', nextval('idem.token_seq'), NULL, '{"v": 2}', NULL, NULL, $1::date + interval '1 day', now(), now() + interval '30 days'),
		       ('up', 'failed-1', $2::date, 'failed', nextval('idem.token_seq'), NULL, NULL, 'card declined', false, $2::date + interval '1 day', now(), now() + interval '30 days'),
		       ('up', 'leased-1', $2::date, 'processing', nextval('idem.token_seq'), now() + interval '1 hour', NULL, NULL, NULL, $2::date + interval '1 day', now(), now() + interval '30 days')`,
		month(-2), month(-1)); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT token FROM idem.claim('up', 'v3-claimed')`).Scan(&leasedToken); err != nil {
		t.Fatal(err)
	}

	check := func(t *testing.T, stage string) {
		t.Helper()
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		c, err := idem.New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		if cl, err := c.Claim(ctx, "up", "done-2"); err != nil || cl.Outcome != idem.Completed || string(cl.Result) != `{"v": 2}` {
			t.Fatalf("%s: a key completed two months ago: %+v %v", stage, cl, err)
		}
		if cl, err := c.Claim(ctx, "up", "failed-1"); err != nil || cl.Outcome != idem.Failed || cl.Error != "card declined" {
			t.Fatalf("%s: a failed key: %+v %v", stage, cl, err)
		}
		if cl, err := c.Claim(ctx, "up", "leased-1"); err != nil || cl.Outcome != idem.InProgress || cl.LeaseRemaining < 50*time.Minute {
			t.Fatalf("%s: a leased key: %+v %v", stage, cl, err)
		}
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.claim(text,text,text,interval,interval,text,interval)', 'EXECUTE')
		                                   AND has_function_privilege($1, 'idem.complete_unstored(text,text,bigint,text)', 'EXECUTE')
		                                   AND NOT has_function_privilege($1, 'idem.prune_batch(text,integer)', 'EXECUTE')`, role).Scan(&ok); err != nil || !ok {
			t.Fatalf("%s: the application role's rights: %v %v", stage, ok, err)
		}
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	check(t, "after the upgrade")
	{
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		c, err := idem.New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Complete(ctx, "up", "v3-claimed", leasedToken, json.RawMessage(`{"v": 3}`)); err != nil {
			t.Fatalf("completing a version-3 claim with its token: %v", err)
		}
		pool.Close()
	}

	if _, err := p.DownTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'done-2')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("version 3 again: %q %v", outcome, err)
	}
	var ok bool
	if err := db.QueryRowContext(ctx, `SELECT has_function_privilege($1, 'idem.claim(text,text,text,interval,interval,text)', 'EXECUTE')`, role).Scan(&ok); err != nil || !ok {
		t.Fatalf("down to 3: the role lost its right on claim: %v %v", ok, err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	check(t, "down and up again")
}

// TestUpgradeTo5: version 4 holding keys spread over several months (one
// first seen four months ago whose expires_at was pushed 30 days ahead by
// extends, one of a one-year source first seen eight months ago, a leased
// one, per-key duplicate counts) and an application and a maintainer role
// is upgraded to version 5 (claim v2, which probes only the months a live
// row can be in): every key answers as before, the leased one completes with
// its old token, the counts and rights carry over; down to 4 and up again.
func TestUpgradeTo5(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 4); err != nil {
		t.Fatal(err)
	}
	suffix := time.Now().UnixNano()
	app, maint := fmt.Sprintf("idem_up5_app_%d", suffix), fmt.Sprintf("idem_up5_maint_%d", suffix)
	for _, role := range []string{app, maint} {
		if _, err := db.ExecContext(ctx, `CREATE ROLE `+role); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = db.ExecContext(context.Background(), `DROP OWNED BY `+role)
			_, _ = db.ExecContext(context.Background(), `DROP ROLE `+role)
		})
	}
	if _, err := db.ExecContext(ctx, `SELECT idem.grant_app($1::regrole), idem.grant_maintainer($2::regrole)`, app, maint); err != nil {
		t.Fatal(err)
	}
	month := func(add int) time.Time { return testdb.MonthStart(time.Now(), add) }
	for _, m := range []int{-8, -4, -3, -1} {
		if _, err := db.ExecContext(ctx, `SELECT idem.create_partition($1::date)`, month(m)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('year', '1 year', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, result, first_seen, updated_at, expires_at, duplicates)
		VALUES ('up', 'extended-4', $1::date, 'completed', idem.new_token(), NULL, '{"v": 4}', $1::date + interval '2 days', now(), now() + interval '30 days', 0),
		       ('up', 'done-3', $2::date, 'completed', idem.new_token(), NULL, '{"v": 3}', $2::date + interval '20 days', now(), now() + interval '1 day', 16),
		       ('year', 'old-8', $3::date, 'completed', idem.new_token(), NULL, '{"v": 8}', $3::date + interval '3 days', now(), $3::date + interval '3 days 1 year', 8),
		       ('up', 'leased-1', $4::date, 'processing', 42, now() + interval '1 hour', NULL, $4::date + interval '1 day', now(), now() + interval '30 days', 0)`,
		month(-4), month(-3), month(-8), month(-1)); err != nil {
		t.Fatal(err)
	}

	check := func(t *testing.T, stage string) {
		t.Helper()
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		// The SQL protocol itself: the Go client refuses a schema older
		// than the functions it calls (TestOldSchema).
		claim := func(source, key string) (outcome, result string, err error) {
			err = pool.QueryRow(ctx, `SELECT outcome, coalesce(result::text, '') FROM idem.claim($1, $2)`, source, key).Scan(&outcome, &result)
			return outcome, result, err
		}
		for key, want := range map[[2]string]string{{"up", "extended-4"}: `{"v": 4}`, {"up", "done-3"}: `{"v": 3}`, {"year", "old-8"}: `{"v": 8}`} {
			if outcome, result, err := claim(key[0], key[1]); err != nil || outcome != string(idem.Completed) || result != want {
				t.Fatalf("%s: %v: %s %s %v", stage, key, outcome, result, err)
			}
		}
		if outcome, _, err := claim("up", "leased-1"); err != nil || outcome != string(idem.InProgress) {
			t.Fatalf("%s: a leased key: %s %v", stage, outcome, err)
		}
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.claim(text,text,text,interval,interval,text,interval)', 'EXECUTE')
		                                   AND NOT has_function_privilege($1, 'idem.prune_batch(text,integer)', 'EXECUTE')
		                                   AND has_function_privilege($2, 'idem.prune_batch(text,integer)', 'EXECUTE')`, app, maint).Scan(&ok); err != nil || !ok {
			t.Fatalf("%s: the roles' rights: %v %v", stage, ok, err)
		}
	}
	check(t, "version 4")
	var want int64 // version 4 counted some of check's duplicates in the rows
	if err := db.QueryRowContext(ctx, `SELECT sum(duplicates) FROM idem.processed_events`).Scan(&want); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	var lookback time.Duration
	var dups int64
	var maintOK bool
	if err := db.QueryRowContext(ctx, `
		SELECT extract(epoch FROM (SELECT max(lookback) FROM idem.lookbacks WHERE source IN ('up', '*')))::bigint * 1000000000,
		       (SELECT sum(duplicates) FROM idem.duplicate_counts WHERE source IN ('up', 'year')),
		       has_table_privilege($1, 'idem.lookbacks', 'SELECT') AND has_table_privilege($1, 'idem.duplicate_counts', 'SELECT')
		       AND has_function_privilege($1, 'idem.compact_duplicate_counts()', 'EXECUTE')`, maint).Scan(&lookback, &dups, &maintOK); err != nil {
		t.Fatal(err)
	}
	if lookback < 120*24*time.Hour || dups != want || !maintOK {
		t.Fatalf("after the upgrade: lookback of 'up' %s (want at least the 4 months its oldest live key needs), carried duplicates %d (want %d), maintainer rights %v",
			lookback, dups, want, maintOK)
	}
	check(t, "after the upgrade to 5")
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if err := mustClient(t, pool).Complete(ctx, "up", "leased-1", 42, json.RawMessage(`{"v": 1}`)); err != nil {
		t.Fatalf("completing a version-4 lease with its token: %v", err)
	}
	pool.Close()

	if _, err := p.DownTo(ctx, 4); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'extended-4')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("version 4 again: %q %v", outcome, err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'leased-1')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("down and up again: %q %v", outcome, err)
	}
	for _, k := range [][2]string{{"up", "extended-4"}, {"year", "old-8"}} {
		if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim($1, $2)`, k[0], k[1]).Scan(&outcome); err != nil || outcome != "completed" {
			t.Fatalf("down and up again: %v: %q %v", k, outcome, err)
		}
	}
}

// setupAt opens an empty database and a migration provider on it.
func setupAt(t *testing.T) (string, *sql.DB, *goose.Provider) {
	t.Helper()
	url := testdb.NewEmpty(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	return url, db, p
}

// TestUpgradeTo6: a version-5 installation holding keys over several
// months (some expired), per-backend duplicate counts and a maintainer role
// is upgraded to version 6 (maintenance steps shared by idemctl and the
// procedures, idem's own SQLSTATEs): every live key answers as before, the
// maintainer can run CALL idem.prune() (which now folds the duplicate
// counts) and idem.partitions_to_retire(); down to 5 and up again.
func TestUpgradeTo6(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 5); err != nil {
		t.Fatal(err)
	}
	maint := fmt.Sprintf("idem_up6_maint_%d", time.Now().UnixNano())
	if _, err := db.ExecContext(ctx, `CREATE ROLE `+maint); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), `DROP OWNED BY `+maint)
		_, _ = db.ExecContext(context.Background(), `DROP ROLE `+maint)
	})
	if _, err := db.ExecContext(ctx, `SELECT idem.grant_maintainer($1::regrole)`, maint); err != nil {
		t.Fatal(err)
	}
	month := func(add int) time.Time { return testdb.MonthStart(time.Now(), add) }
	for _, m := range []int{-2, -1} {
		if _, err := db.ExecContext(ctx, `SELECT idem.create_partition($1::date)`, month(m)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, expires_at)
		SELECT 'up', 'live-' || m || '-' || g, idem.utc_month(now()) + make_interval(months => m), 'completed', idem.new_token(),
		       '{"v": 1}'::jsonb, idem.utc_month(now()) + make_interval(months => m, days => 1), now(), now() + interval '20 days'
		  FROM generate_series(-1, 0) m, generate_series(1, 50) g
		UNION ALL
		SELECT 'up', 'gone-' || g, idem.utc_month(now()) - interval '2 months', 'completed', idem.new_token(),
		       NULL::jsonb, idem.utc_month(now()) - interval '2 months' + interval '1 day', now(), now() - interval '1 hour'
		  FROM generate_series(1, 300) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.duplicate_counts (source, slot, duplicates, since, last_seen_at)
		SELECT 'up', g, 3, now(), now() FROM generate_series(1, 25) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	claimAll := func(stage string) {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, `
			SELECT count(*) FROM generate_series(-1, 0) m, generate_series(1, 50) g,
			       LATERAL idem.claim('up', 'live-' || m || '-' || g) c WHERE c.outcome = 'completed'`).Scan(&n); err != nil || n != 100 {
			t.Fatalf("%s: %d of 100 live keys answered completed (%v)", stage, n, err)
		}
	}
	claimAll("after the upgrade to 6")

	// The maintainer runs the pg_cron procedure: expired rows go, counts fold.
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `SET ROLE `+maint); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `CALL idem.prune()`); err != nil {
		t.Fatalf("CALL idem.prune() as the maintainer: %v", err)
	}
	var retire int
	if err := conn.QueryRowContext(ctx, `SELECT count(*) FROM idem.partitions_to_retire()`).Scan(&retire); err != nil || retire != 2 {
		t.Fatalf("idem.partitions_to_retire() as the maintainer: %d %v (want the two past months)", retire, err)
	}
	var months int
	if err := conn.QueryRowContext(ctx, `SELECT count(*) FROM idem.partition_months()`).Scan(&months); err != nil || months < 5 {
		t.Fatalf("idem.partition_months() as the maintainer: %d %v", months, err)
	}
	_, _ = conn.ExecContext(ctx, `RESET ROLE`)
	conn.Close()
	var gone, slots, dups int
	if err := db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM idem.processed_events WHERE key LIKE 'gone-%'),
	                                          (SELECT count(*) FROM idem.duplicate_counts WHERE source = 'up'),
	                                          (SELECT sum(duplicates) FROM idem.duplicate_counts WHERE source = 'up')`).Scan(&gone, &slots, &dups); err != nil {
		t.Fatal(err)
	}
	// check's claims above were duplicates too: at least the seeded 75.
	if gone != 0 || slots != 1 || dups < 75 {
		t.Fatalf("after CALL idem.prune(): %d expired rows left, %d count rows for 'up' summing to %d; want 0, 1, >= 75", gone, slots, dups)
	}
	var code string
	_, err = db.ExecContext(ctx, `SELECT idem.prune_batch('nobody', 10)`)
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) {
		code = pe.Code
	}
	if code != "ID001" {
		t.Fatalf("prune_batch without the lock at version 6: %v, want SQLSTATE ID001", err)
	}

	if _, err := p.DownTo(ctx, 5); err != nil {
		t.Fatal(err)
	}
	claimAll("down to 5")
	code = ""
	_, err = db.ExecContext(ctx, `SELECT idem.prune_batch('nobody', 10)`)
	if pe := (*pgconn.PgError)(nil); errors.As(err, &pe) {
		code = pe.Code
	}
	if code != "55P03" {
		t.Fatalf("prune_batch without the lock at version 5: %v, want version 5's 55P03", err)
	}
	if _, err := db.ExecContext(ctx, `CALL idem.prune()`); err != nil {
		t.Fatalf("version 5's CALL idem.prune(): %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	claimAll("up to 6 again")
}

// appAndMaintainer creates two roles for the test (dropped at its end),
// granted the application's and the maintainer's rights at the current
// version, and returns their names.
func appAndMaintainer(t *testing.T, db *sql.DB, prefix string) (app, maint string) {
	t.Helper()
	ctx := context.Background()
	stamp := time.Now().UnixNano()
	app, maint = fmt.Sprintf("%s_app_%d", prefix, stamp), fmt.Sprintf("%s_maint_%d", prefix, stamp)
	for _, r := range []string{app, maint} {
		if _, err := db.ExecContext(ctx, `CREATE ROLE `+r); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = db.ExecContext(context.Background(), `DROP OWNED BY `+r)
			_, _ = db.ExecContext(context.Background(), `DROP ROLE `+r)
		})
	}
	if _, err := db.ExecContext(ctx, `SELECT idem.grant_app($1::regrole), idem.grant_maintainer($2::regrole)`, app, maint); err != nil {
		t.Fatal(err)
	}
	return app, maint
}

// seedCompleted stores 100 completed keys of source 'up' ("done-1" to
// "done-100", result {"v": 1}), for an upgrade test to claim before and
// after; completedAnswered checks that every one answers completed with
// its result.
func seedCompleted(t *testing.T, db *sql.DB) {
	t.Helper()
	if _, err := db.ExecContext(context.Background(), `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, expires_at)
		SELECT 'up', 'done-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"v": 1}'::jsonb, now(), now(), now() + interval '20 days'
		  FROM generate_series(1, 100) g`); err != nil {
		t.Fatal(err)
	}
}

// seededAnswered checks what seedCompleted and a claim of ('up',
// 'running') with a long lease left behind: the 100 completed keys answer
// with their results, and the key in progress answers in_progress.
func seededAnswered(t *testing.T, db *sql.DB, stage string) {
	t.Helper()
	completedAnswered(t, db, stage)
	var running string
	if err := db.QueryRowContext(context.Background(), `SELECT outcome FROM idem.claim('up', 'running')`).Scan(&running); err != nil || running != "in_progress" {
		t.Fatalf("%s: the key in progress answered %q (%v)", stage, running, err)
	}
}

func completedAnswered(t *testing.T, db *sql.DB, stage string) {
	t.Helper()
	var n int
	if err := db.QueryRowContext(context.Background(), `SELECT count(*) FROM generate_series(1, 100) g, LATERAL idem.claim('up', 'done-' || g) c
	                                    WHERE c.outcome = 'completed' AND c.result = '{"v": 1}'`).Scan(&n); err != nil || n != 100 {
		t.Fatalf("%s: %d of 100 keys answered completed with their result (%v)", stage, n, err)
	}
}

// mustClient is idem.New(pool, nil), failing the test on an error.
func mustClient(t *testing.T, pool *pgxpool.Pool) *idem.Client {
	t.Helper()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
