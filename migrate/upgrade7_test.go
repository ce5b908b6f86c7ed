package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo7: a version-6 database holding keys, an application role,
// a maintainer role and an event accepted for the inbox before holds
// existed (its key processing under the job's token). After the upgrade
// every key answers as before; the roles have the queue functions (the
// application role takes, the maintainer replays and reads the holds);
// the old job's key is taken (and held from then on); and the database
// goes down to 6 and up again.
func TestUpgradeTo7(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 6); err != nil {
		t.Fatal(err)
	}
	app, maint := appAndMaintainer(t, db, "idem_up7")
	seedCompleted(t, db)
	var legacy int64
	if err := db.QueryRowContext(ctx, `SELECT token FROM idem.claim('inbox', 'legacy-job', lease => '1 hour')`).Scan(&legacy); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	completedAnswered(t, db, "after the upgrade to 7")
	var rights bool
	if err := db.QueryRowContext(ctx, `SELECT has_function_privilege($1, 'idem.queue_take(text, text, bigint, bigint, interval)', 'EXECUTE')
		AND has_function_privilege($1, 'idem.queue_complete(text, text, bigint, bigint, jsonb, text)', 'EXECUTE')
		AND has_table_privilege($1, 'idem.holds', 'SELECT')
		AND has_function_privilege($2, 'idem.queue_replay(text, text, bigint, interval)', 'EXECUTE')
		AND has_table_privilege($2, 'idem.holds', 'SELECT')
		AND NOT has_function_privilege($2, 'idem.claim(text, text, text, interval, interval, text, interval)', 'EXECUTE')
		AND NOT has_function_privilege($1, 'idem.prune_batch(text, integer)', 'EXECUTE')`, app, maint).Scan(&rights); err != nil || !rights {
		t.Fatalf("the roles' rights after the upgrade: %v %v", rights, err)
	}
	// The job accepted before version 7 is taken, and held from then on.
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SET ROLE `+app); err != nil {
		t.Fatal(err)
	}
	var outcome string
	var token int64
	if err := conn.QueryRowContext(ctx, `SELECT outcome, token FROM idem.queue_take('inbox', 'legacy-job', $1, 42, '1 minute')`, legacy).Scan(&outcome, &token); err != nil || outcome != "taken" || token == legacy {
		t.Fatalf("queue_take of a job accepted at version 6: %s %d %v", outcome, token, err)
	}
	if err := conn.QueryRowContext(ctx, `SELECT c.outcome FROM idem.claim('inbox', 'legacy-job') c`).Scan(&outcome); err != nil || outcome != "in_progress" {
		t.Fatalf("a claim of the held key: %s %v", outcome, err)
	}
	if err := conn.QueryRowContext(ctx, `SELECT idem.queue_complete('inbox', 'legacy-job', $1, $2, '{"ok": true}')`, legacy, token).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("queue_complete: %s %v", outcome, err)
	}
	var accepted, processed, held int
	if err := conn.QueryRowContext(ctx, `SELECT (SELECT sum(accepted) FROM idem.queue_counts), (SELECT sum(processed) FROM idem.queue_counts), (SELECT count(*) FROM idem.holds)`).Scan(&accepted, &processed, &held); err != nil || accepted != 1 || processed != 1 || held != 0 {
		t.Fatalf("counts %d accepted, %d processed, %d held (%v); want 1, 1, 0", accepted, processed, held, err)
	}
	_, _ = conn.ExecContext(ctx, `RESET ROLE`)

	if _, err := p.DownTo(ctx, 6); err != nil {
		t.Fatal(err)
	}
	completedAnswered(t, db, "down to 6")
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('idem.holds') IS NULL AND to_regprocedure('idem.queue_take(text, text, bigint, bigint, interval)') IS NULL`).Scan(&gone); err != nil || !gone {
		t.Fatalf("version 7's objects left after down: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	completedAnswered(t, db, "up to 7 again")
}
