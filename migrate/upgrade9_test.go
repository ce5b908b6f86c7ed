package migrate_test

import (
	"context"
	"testing"
)

// TestUpgradeTo9: from version 8 holding data (completed keys, a key in
// progress), the upgrade to 9 keeps every answer; an adoption started at 9
// makes claims answer a legacy event as completed (adopted on the spot)
// while it copies; down to 8 removes the adoptions and claim version 9,
// keeping every answer; up again works.
func TestUpgradeTo9(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 8); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, expires_at)
		SELECT 'up', 'done-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"v": 1}'::jsonb, now(), now(), now() + interval '20 days'
		  FROM generate_series(1, 100) g;
		SELECT idem.claim('up', 'running', lease => '1 hour');
		CREATE TABLE public.legacy_events (id text PRIMARY KEY, at timestamptz NOT NULL);
		INSERT INTO public.legacy_events VALUES ('evt_old', now() - interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	answers := func(stage string) {
		t.Helper()
		var n int
		var running string
		if err := db.QueryRowContext(ctx, `SELECT count(*) FILTER (WHERE c.outcome = 'completed' AND c.result = '{"v": 1}'),
		                                          (SELECT r.outcome FROM idem.claim('up', 'running') r)
		                                     FROM generate_series(1, 100) g, LATERAL idem.claim('up', 'done-' || g) c`).Scan(&n, &running); err != nil || n != 100 || running != "in_progress" {
			t.Fatalf("%s: %d of 100 completed keys answered, the key in progress %q (%v)", stage, n, running, err)
		}
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	answers("after the upgrade to 9")
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT idem.adopt_start('up', 'public.legacy_events', 'id', 'at')`).Scan(new(int64)); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'evt_old')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("a legacy event while adopting: %s %v", outcome, err)
	}
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'evt_new')`).Scan(&outcome); err != nil || outcome != "acquired" {
		t.Fatalf("a new event while adopting: %s %v", outcome, err)
	}
	if _, err := p.DownTo(ctx, 8); err != nil {
		t.Fatal(err)
	}
	answers("down to 8")
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('idem.adoptions') IS NULL AND to_regprocedure('idem.adopt_key(bigint, text, timestamptz, date, date)') IS NULL`).Scan(&gone); err != nil || !gone {
		t.Fatalf("version 9's objects left after down: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	answers("up to 9 again")
}
