package migrate_test

import (
	"context"
	"fmt"
	"strconv"
	"testing"
)

// TestUpgradeTo22: from version 21 holding data (stored keys, and a batch
// claimed but not completed), the upgrade to 22 keeps every answer; the
// batch claimed before it completes after it with its tokens; a batch
// answers new, completed, in-progress and repeated keys as before, and a
// redelivered batch (its first key completed) too. Version 21's
// complete_batch read every processing row of the source for each batch
// when the statistics said there were few (a table that grew since it was
// analyzed); version 22's reads one row per item. Down to 21 restores the
// index and the functions, and up again.
func TestUpgradeTo22(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 21); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	// Statistics taken when the source held only completed keys, then many
	// keys in processing: the estimate of the source's processing rows is
	// near none (autovacuum off, so it stays so).
	for _, tbl := range queryStrings(t, ctx, db, `SELECT c.oid::regclass::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'idem.processed_events'::regclass`) {
		if _, err := db.ExecContext(ctx, `ALTER TABLE `+tbl+` SET (autovacuum_enabled = false)`); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.policies (source, ttl, lease) VALUES ('big', '1 day', '1 hour');
		SELECT count(*) FROM idem.claim_batch('big', (SELECT array_agg('done-' || g) FROM generate_series(1, 1000) g));
		UPDATE idem.processed_events SET status = 'completed', result = '{}' WHERE source = 'big';
		ANALYZE idem.processed_events;
		SELECT (SELECT count(*) FROM idem.claim_batch('big', (SELECT array_agg('open-' || g || '-' || b) FROM generate_series(1, 1000) g))) FROM generate_series(1, 5) b`); err != nil {
		t.Fatal(err)
	}
	// claim claims ten keys in a batch and returns their tokens.
	claim := func(prefix string) (keys []string, tokens []int64) {
		t.Helper()
		for _, tok := range queryStrings(t, ctx, db, `SELECT token::text FROM idem.claim_batch('big', (SELECT array_agg($1 || g) FROM generate_series(1, 10) g)) ORDER BY ord`, prefix) {
			n, err := strconv.ParseInt(tok, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			keys, tokens = append(keys, fmt.Sprintf("%s%d", prefix, len(keys)+1)), append(tokens, n)
		}
		return keys, tokens
	}
	// complete completes them in one call in a transaction and returns the
	// outcomes and the rows that call fetched from processed_events.
	complete := func(keys []string, tokens []int64) (outcomes string, fetched int64) {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		// The backend's counters not yet reported (PostgreSQL 15 keeps
		// earlier transactions' there too): read before and after.
		read := func() (n int64) {
			t.Helper()
			if err := tx.QueryRowContext(ctx, `SELECT coalesce(sum(idx_tup_fetch + seq_tup_read), 0) FROM pg_stat_xact_user_tables WHERE schemaname = 'idem' AND relname LIKE 'processed_events%'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		before := read()
		if err := tx.QueryRowContext(ctx, `SELECT string_agg(outcome, ',' ORDER BY ord) FROM idem.complete_batch('big', $1::text[], $2::bigint[], array_fill('{"ok": true}'::jsonb, ARRAY[10]))`,
			keys, tokens).Scan(&outcomes); err != nil {
			t.Fatal(err)
		}
		after := read()
		fetched = after - before
		if err := tx.Commit(); err != nil {
			t.Fatal(err)
		}
		return outcomes, fetched
	}
	const allDone = "completed,completed,completed,completed,completed,completed,completed,completed,completed,completed"
	keys, tokens := claim("v21-")
	if out, fetched := complete(keys, tokens); out != allDone || fetched < 1000 {
		t.Fatalf("version 21: %q, %d rows fetched; want every key completed and the source's 5,000 processing rows read (the plan this migration replaces)", out, fetched)
	}
	pending, pendingTokens := claim("across-")

	if _, err := p.UpTo(ctx, 22); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 22")
	var idx int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = 'idem' AND indexname = 'processed_events_expires_at_idx'`).Scan(&idx); err != nil || idx != 0 {
		t.Fatalf("version 22: processed_events_expires_at_idx still there (%d, %v)", idx, err)
	}
	if out, fetched := complete(pending, pendingTokens); out != allDone || fetched > 100 {
		t.Fatalf("version 22, the batch claimed at 21: %q, %d rows fetched; want every key completed, a few rows per item", out, fetched)
	}
	batch := func(keys ...string) string {
		t.Helper()
		var got string
		if err := db.QueryRowContext(ctx, `SELECT string_agg(outcome, ',' ORDER BY ord) FROM idem.claim_batch('up', $1::text[])`, keys).Scan(&got); err != nil {
			t.Fatal(err)
		}
		return got
	}
	if got := batch("new-22", "running", "new-22", "done-1"); got != "acquired,in_progress,in_progress,completed" {
		t.Fatalf("version 22: %q", got)
	}
	// A redelivery: the first key completed, read before any lock.
	if got := batch("done-2", "running", "done-3", "new-22b", "done-2"); got != "completed,in_progress,completed,acquired,completed" {
		t.Fatalf("version 22, a redelivered batch: %q", got)
	}

	if _, err := p.DownTo(ctx, 21); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 21")
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_indexes WHERE schemaname = 'idem' AND indexname = 'processed_events_expires_at_idx'`).Scan(&idx); err != nil || idx != 1 {
		t.Fatalf("down to 21: processed_events_expires_at_idx not restored (%d, %v)", idx, err)
	}
	if got := batch("new-21", "running", "done-1"); got != "acquired,in_progress,completed" {
		t.Fatalf("down to 21: %q", got)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if got := batch("new-21", "done-1", "new-up"); got != "in_progress,completed,acquired" {
		t.Fatalf("up again: %q", got)
	}
}
