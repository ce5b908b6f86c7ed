package migrate_test

import (
	"context"
	"database/sql"
	"testing"
)

// TestUpgradeTo20: from version 19 holding data, the upgrade to 20
// (idem.fail version 20) keeps every answer; a failure recorded with
// retryable => NULL (a momentary one: 429, 503) releases the key and takes
// back the attempt its claim counted, so max_attempts such failures do
// not fail the key for good; version 19 took NULL as a counted retryable
// failure, and so does the schema down to 19 again.
func TestUpgradeTo20(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 19); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('rl', '1 day', '1 minute', 2)`); err != nil {
		t.Fatal(err)
	}
	// momentary claims key k and fails it with retryable => NULL three
	// times, and returns the last claim's outcome and the key's attempts.
	momentary := func(k string) (outcome string, attempts int) {
		t.Helper()
		for range 3 {
			var token sql.NullInt64
			if err := db.QueryRowContext(ctx, `SELECT outcome, token FROM idem.claim('rl', $1)`, k).Scan(&outcome, &token); err != nil {
				t.Fatal(err)
			}
			if outcome != "acquired" {
				break
			}
			var out string
			if err := db.QueryRowContext(ctx, `SELECT idem.fail('rl', $1, $2, 'handler answered 429', NULL)`, k, token.Int64).Scan(&out); err != nil || out != "failed" {
				t.Fatalf("fail: %q, %v", out, err)
			}
		}
		if err := db.QueryRowContext(ctx, `SELECT attempts FROM idem.processed_events WHERE source = 'rl' AND key = $1`, k).Scan(&attempts); err != nil {
			t.Fatal(err)
		}
		return outcome, attempts
	}
	if outcome, _ := momentary("v16"); outcome != "failed" {
		t.Fatalf("version 19: three momentary failures under max_attempts 2 gave %q, want failed (counted)", outcome)
	}

	if _, err := p.UpTo(ctx, 20); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 20")
	if outcome, attempts := momentary("v20"); outcome != "acquired" || attempts != 0 {
		t.Fatalf("version 20: %q with %d attempts, want acquired with 0 (not counted)", outcome, attempts)
	}
	// A counted retryable failure still counts.
	var token int64
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome, token FROM idem.claim('rl', 'v20')`).Scan(&outcome, &token); err != nil || outcome != "acquired" {
		t.Fatalf("claim: %q, %v", outcome, err)
	}
	if _, err := db.ExecContext(ctx, `SELECT idem.fail('rl', 'v20', $1, 'boom', true)`, token); err != nil {
		t.Fatal(err)
	}
	var attempts int
	if err := db.QueryRowContext(ctx, `SELECT attempts FROM idem.processed_events WHERE source = 'rl' AND key = 'v20'`).Scan(&attempts); err != nil || attempts != 1 {
		t.Fatalf("a counted failure: attempts %d, %v, want 1", attempts, err)
	}

	if _, err := p.DownTo(ctx, 19); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 19")
	if outcome, _ := momentary("down"); outcome != "failed" {
		t.Fatalf("down to 19: %q, want failed (counted)", outcome)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if outcome, attempts := momentary("up again"); outcome != "acquired" || attempts != 0 {
		t.Fatalf("up again: %q with %d attempts, want acquired with 0", outcome, attempts)
	}
}
