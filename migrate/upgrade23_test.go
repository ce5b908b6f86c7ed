package migrate_test

import (
	"context"
	"strings"
	"testing"
)

// TestUpgradeTo23: from version 22 holding data (stored keys, a key in
// progress, a busy source), the upgrade to 23 keeps every answer, and a
// redelivered batch (its first key completed) answers as before. Version
// 22 counted the duplicates of every redelivered batch, so every one wrote
// (two upserts and a commit); version 23 weighs a batch as one claim: below
// the exact-counting rate each batch is still counted exactly, above it one
// batch in the policy's duplicate_sampling (8) is counted, as 8 times its
// duplicates, and the others write nothing. Down to 22 and up again.
func TestUpgradeTo23(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 22); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	// Source 'up' above the exact-counting rate in this minute and the
	// next (the test may cross a minute); source 'quiet' below it.
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.activity (minute, source, slot, acquired, duplicates)
		SELECT idem.activity_minute(now() + m * interval '1 minute'), 'up', 0, 100000, 0 FROM generate_series(0, 1) m;
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, expires_at)
		SELECT 'quiet', 'done-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"v": 1}'::jsonb, now(), now(), now() + interval '20 days'
		  FROM generate_series(1, 10) g`); err != nil {
		t.Fatal(err)
	}

	counted := func(source string) (n int64) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = $1`, source).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// redeliver claims the ten keys "done-1" to "done-10" of source in a
	// batch, each in a transaction of its own, n times: how many of those
	// transactions wrote, and the duplicates counted meanwhile.
	redeliver := func(stage, source string, n int) (wrote int, dups int64) {
		t.Helper()
		before := counted(source)
		for i := 0; i < n; i++ {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			var got string
			var writes bool
			if err := tx.QueryRowContext(ctx, `SELECT string_agg(outcome || ':' || result::text, ',' ORDER BY ord) FROM idem.claim_batch($1, (SELECT array_agg('done-' || g) FROM generate_series(1, 10) g))`, source).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if want := "completed:{\"v\": 1}"; got != strings.TrimSuffix(strings.Repeat(want+",", 10), ",") {
				_ = tx.Rollback()
				t.Fatalf("%s: a redelivered batch of %s answered %q", stage, source, got)
			}
			if err := tx.QueryRowContext(ctx, `SELECT pg_current_xact_id_if_assigned() IS NOT NULL`).Scan(&writes); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if writes {
				wrote++
			}
		}
		return wrote, counted(source) - before
	}
	batch := func(stage string, keys ...string) string {
		t.Helper()
		var got string
		if err := db.QueryRowContext(ctx, `SELECT string_agg(outcome, ',' ORDER BY ord) FROM idem.claim_batch('up', $1::text[])`, keys).Scan(&got); err != nil {
			t.Fatalf("%s: %v", stage, err)
		}
		return got
	}

	if wrote, dups := redeliver("version 22", "up", 40); wrote != 40 || dups != 400 {
		t.Fatalf("version 22: %d of 40 redelivered batches wrote, %d duplicates counted; want every one counted (the behaviour this migration replaces)", wrote, dups)
	}
	if got := batch("version 22", "done-2", "running", "done-3", "new-22", "done-2"); got != "completed,in_progress,completed,acquired,completed" {
		t.Fatalf("version 22, a redelivered batch: %q", got)
	}

	if _, err := p.UpTo(ctx, 23); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 23")
	// Above the rate: with 1 in 8 counted, 20 or more of 40 happens about
	// once in 10^8 runs.
	wrote, dups := redeliver("version 23", "up", 40)
	if wrote >= 20 || dups != int64(wrote)*80 {
		t.Fatalf("version 23, above the rate: %d of 40 redelivered batches wrote, %d duplicates counted; want about 1 in 8, each counted as 8 x 10", wrote, dups)
	}
	// Below the rate: every batch counted exactly.
	if wrote, dups := redeliver("version 23", "quiet", 3); wrote != 3 || dups != 30 {
		t.Fatalf("version 23, below the rate: %d of 3 batches wrote, %d duplicates counted; want 3 and 30", wrote, dups)
	}
	if got := batch("version 23", "done-2", "running", "done-3", "new-23", "done-2", "new-22"); got != "completed,in_progress,completed,acquired,completed,in_progress" {
		t.Fatalf("version 23, a redelivered batch: %q", got)
	}

	if _, err := p.DownTo(ctx, 22); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 22")
	if wrote, dups := redeliver("down to 22", "up", 5); wrote != 5 || dups != 50 {
		t.Fatalf("down to 22: %d of 5 batches wrote, %d duplicates counted", wrote, dups)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if got := batch("up again", "done-4", "new-up", "new-23"); got != "completed,acquired,in_progress" {
		t.Fatalf("up again: %q", got)
	}
}
