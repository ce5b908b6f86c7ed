package migrate_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/migrate"
)

// TestUpgradeTo11: from version 10 holding data (completed keys, a key in
// progress, expired rows) with app and maintainer roles, the upgrade to 11
// keeps every answer on a single node (not distributed: claim's Citus
// check is off); the app role completes with complete_stored; the maintainer prunes (version 11's prune_batch, its
// single-node path) and rotates (months_to_create in plpgsql); Citus'
// setup refuses without Citus, naming what to do; down to 10 and up again.
func TestUpgradeTo11(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 10); err != nil {
		t.Fatal(err)
	}
	app, maint := appAndMaintainer(t, db, "idem_up11")
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour');
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at, completed_at)
		SELECT 'up', 'old' || g, idem.utc_month(now()), 'completed', 1, g, now() - interval '2 days', now() - interval '2 days',
		       now() - interval '1 day', now() - interval '2 days'
		  FROM generate_series(1, 50) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 11")
	if d, err := migrate.Distributed(ctx, db); err != nil || d {
		t.Fatalf("Distributed on a single node: %v %v", d, err)
	}
	var acquired string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'new-at-11')`).Scan(&acquired); err != nil || acquired != "acquired" {
		t.Fatalf("a new key at 11: %q %v", acquired, err)
	}

	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// The application's role, granted at 10, completes the way Do does at
	// 11 (complete_stored, granted by the upgrade).
	if _, err := conn.ExecContext(ctx, `SET ROLE `+app); err != nil {
		t.Fatal(err)
	}
	var token int64
	if err := conn.QueryRowContext(ctx, `SELECT token FROM idem.claim('up', 'app-at-11')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	var outcome, stored string
	if err := conn.QueryRowContext(ctx, `SELECT c.outcome, c.stored FROM idem.complete_stored('up', 'app-at-11', $1, '{"b": 1,  "a": 2}') c`,
		token).Scan(&outcome, &stored); err != nil || outcome != "completed" || stored != `{"a": 2, "b": 1}` {
		t.Fatalf("complete_stored as the app role: %q %q %v", outcome, stored, err)
	}
	if _, err := conn.ExecContext(ctx, `RESET ROLE; SET ROLE `+maint); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `CALL idem.prune()`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `CALL idem.rotate(premake => 5)`); err != nil {
		t.Fatal(err)
	}
	var left, months int
	if err := conn.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM idem.processed_events WHERE key LIKE 'old%'),
		(SELECT count(*) FROM idem.months_to_create(5))`).Scan(&left, &months); err != nil || left != 0 || months != 0 {
		t.Fatalf("after prune and rotate as the maintainer: %d expired rows left, %d months to create (%v)", left, months, err)
	}
	if _, err := conn.ExecContext(ctx, `RESET ROLE`); err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Citus(ctx, db); err == nil {
		t.Fatal("migrate.Citus without Citus: no error")
	} else {
		t.Logf("migrate.Citus without Citus: %v", err)
	}

	if _, err := p.DownTo(ctx, 10); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 10")
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regprocedure('idem.citus_setup()') IS NULL AND to_regprocedure('idem.distributed()') IS NULL
		AND (SELECT l.lanname = 'sql' FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang WHERE p.oid = 'idem.months_to_create(integer)'::regprocedure)`).Scan(&gone); err != nil || !gone {
		t.Fatalf("version 11's objects left after down: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 11 again")
}
