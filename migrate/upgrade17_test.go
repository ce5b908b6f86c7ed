package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo17: from version 16 holding data and a dead letter, the
// upgrade to 17 keeps them; idem.queue_keep_payload keeps a payload on
// that job's dead hold only (another token: false), refuses a payload that
// is not an object, and the app role may call it (not PUBLIC). Down to 16
// drops the function and the column and keeps the hold; up again.
func TestUpgradeTo17(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 16); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.holds (source, key, token, job_id, state, held_at, dead_at, error)
		VALUES ('dl', 'evt_1', 42, 7, 'dead', now(), now(), 'boom')`); err != nil {
		t.Fatal(err)
	}
	holds := func(when string) {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.holds WHERE source = 'dl' AND state = 'dead' AND error = 'boom'`).Scan(&n); err != nil || n != 1 {
			t.Fatalf("%s: %d dead holds (%v), want 1", when, n, err)
		}
	}

	if _, err := p.UpTo(ctx, 17); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 17")
	holds("after the upgrade to 17")
	keep := func(token int, payload string) (kept bool, err error) {
		err = db.QueryRowContext(ctx, `SELECT idem.queue_keep_payload('dl', 'evt_1', $1, $2::jsonb)`, token, payload).Scan(&kept)
		return kept, err
	}
	if kept, err := keep(41, `{"source":"dl"}`); err != nil || kept {
		t.Fatalf("another job's token: kept %v, %v; want false", kept, err)
	}
	if _, err := keep(42, `[1]`); !isCode(err, "22023") {
		t.Fatalf("an array as payload: %v, want 22023", err)
	}
	if kept, err := keep(42, `{"source":"dl","event_type":"charge"}`); err != nil || !kept {
		t.Fatalf("that job's dead hold: kept %v, %v; want true", kept, err)
	}
	var typ string
	if err := db.QueryRowContext(ctx, `SELECT payload->>'event_type' FROM idem.holds WHERE source = 'dl'`).Scan(&typ); err != nil || typ != "charge" {
		t.Fatalf("kept payload: %q %v", typ, err)
	}
	var public, app bool
	if _, err := db.ExecContext(ctx, `DROP ROLE IF EXISTS idem_app17; CREATE ROLE idem_app17; SELECT idem.grant_app('idem_app17')`); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT has_function_privilege('public', 'idem.queue_keep_payload(text, text, bigint, jsonb)', 'EXECUTE'),
		has_function_privilege('idem_app17', 'idem.queue_keep_payload(text, text, bigint, jsonb)', 'EXECUTE')`).Scan(&public, &app); err != nil {
		t.Fatal(err)
	}
	if public || !app {
		t.Fatalf("EXECUTE: PUBLIC %v (want false), app role %v (want true)", public, app)
	}

	if _, err := p.DownTo(ctx, 16); err != nil {
		t.Fatal(err)
	}
	holds("down to 16")
	var fn, col int
	if err := db.QueryRowContext(ctx, `SELECT (SELECT count(*) FROM pg_proc WHERE proname = 'queue_keep_payload'),
		(SELECT count(*) FROM information_schema.columns WHERE table_schema = 'idem' AND table_name = 'holds' AND column_name = 'payload')`).Scan(&fn, &col); err != nil || fn != 0 || col != 0 {
		t.Fatalf("down to 16: %d functions, %d columns left (%v)", fn, col, err)
	}
	if _, err := db.ExecContext(ctx, `DROP OWNED BY idem_app17; DROP ROLE idem_app17`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	holds("up again")
}
