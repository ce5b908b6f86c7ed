package migrate_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
)

// TestUpgradeTo15: from version 14 holding data and an adoption half
// done over hostile legacy rows (an integer key column; a row stamped a
// year in the future; NULL keys filling a whole first batch; a NULL
// processed-at), the upgrade to 15 keeps every answer and the adoption
// finishes: the future row is a completed key now (a retry is answered,
// not run again), NULL keys are skipped and counted instead of re-read
// forever, claims of '01', ' 1' and a key past the integer range are new
// keys (not legacy row 1, not an error); idem.release ends a key's
// retention 2 seconds later instead of deleting it. Down to 14 restores
// adopt_batch and adopt_key version 9, release version 13 and
// count_duplicate version 10; up again.
func TestUpgradeTo15(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 14); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec(`SELECT idem.claim('up', 'running', lease => '1 hour')`)
	exec(`CREATE TABLE legacy (id bigint, processed_at timestamptz)`)
	exec(`INSERT INTO legacy SELECT NULL, now() - interval '1 day' FROM generate_series(1, 10)`)
	exec(`INSERT INTO legacy VALUES (1, now() - interval '1 day'), (7, now() + interval '1 year'), (8, NULL)`)
	var id int64
	if err := db.QueryRowContext(ctx, `SELECT idem.adopt_start('legacy', 'legacy'::regclass, 'id', 'processed_at', ttl => '30 days')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 15")

	claim := func(key string) string {
		t.Helper()
		var outcome string
		if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('legacy', $1)`, key).Scan(&outcome); err != nil {
			t.Fatalf("claim %q: %v", key, err)
		}
		return outcome
	}
	// While copying: the claim's look-up.
	for key, want := range map[string]string{"1": "completed", "7": "completed", "01": "acquired", " 1": "acquired",
		"99999999999999999999": "acquired", "x": "acquired"} {
		if got := claim(key); got != want {
			t.Errorf("while copying, key %q: %s, want %s", key, got, want)
		}
	}
	// A varchar(3) key column: the cast of 'abcd' truncates to 'abc', which
	// is not that key.
	exec(`CREATE TABLE legacy3 (id varchar(3), processed_at timestamptz)`)
	exec(`INSERT INTO legacy3 VALUES ('abc', now() - interval '1 day')`)
	exec(`SELECT idem.adopt_start('trunc', 'legacy3'::regclass, 'id', 'processed_at', ttl => '30 days')`)
	for key, want := range map[string]string{"abc": "completed", "abcd": "acquired"} {
		var got string
		if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('trunc', $1)`, key).Scan(&got); err != nil || got != want {
			t.Errorf("varchar(3) key %q: %s %v, want %s", key, got, err, want)
		}
	}
	// The copy: a first batch of NULL keys does not stall it.
	for i := 0; ; i++ {
		var done bool
		if err := db.QueryRowContext(ctx, `SELECT done FROM idem.adopt_batch($1, 5)`, id).Scan(&done); err != nil {
			t.Fatal(err)
		}
		if done {
			break
		}
		if i > 10 {
			t.Fatal("the adoption never ends")
		}
	}
	var copied, skipped, future, bad, noStamp int64
	if err := db.QueryRowContext(ctx, `SELECT copied, skipped, future, bad_keys, no_stamp FROM idem.adoptions WHERE id = $1`, id).Scan(&copied, &skipped, &future, &bad, &noStamp); err != nil {
		t.Fatal(err)
	}
	// 1 and 7 were adopted by the claims above: the copy finds them there.
	if copied != 0 || skipped != 13 || future != 1 || bad != 10 || noStamp != 1 {
		t.Errorf("copied %d, skipped %d, future %d, bad keys %d, no stamp %d", copied, skipped, future, bad, noStamp)
	}
	var month, thisMonth string
	if err := db.QueryRowContext(ctx, `SELECT first_seen_month::text, idem.utc_month(now())::text FROM idem.processed_events WHERE source = 'legacy' AND key = '7'`).Scan(&month, &thisMonth); err != nil || month != thisMonth {
		t.Errorf("the future row is in month %s, want this month %s (%v)", month, thisMonth, err)
	}

	// Release: the row stays, its retention ends 2 seconds later.
	var n int64
	if err := db.QueryRowContext(ctx, `SELECT idem.release('up', 'done-1')`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("release: %d %v", n, err)
	}
	var left float64
	if err := db.QueryRowContext(ctx, `SELECT extract(epoch FROM expires_at - now()) FROM idem.processed_events WHERE source = 'up' AND key = 'done-1'`).Scan(&left); err != nil || left <= 0 || left > 2 {
		t.Fatalf("released key's retention: %v s left (%v)", left, err)
	}
	exec(`UPDATE idem.processed_events SET expires_at = now() + interval '20 days' WHERE source = 'up' AND key = 'done-1'`)

	if _, err := p.DownTo(ctx, 14); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 14")
	for fn, want := range map[string]string{"idem.adopt_batch(bigint, integer)": "ORDER BY l.%2$I", "idem.adopt_key(bigint, text, timestamptz, date, date)": "invalid_text_representation",
		"idem.release(text, text)": "DELETE FROM idem.processed_events", "idem.count_duplicate(text, text, date, integer, boolean, timestamptz)": "INSERT INTO idem.duplicate_counts"} {
		if src := prosrc(t, db, fn); !strings.Contains(src, want) || strings.Contains(src, "version 15") {
			t.Errorf("%s after down to 14 is not the previous version", fn)
		}
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 15 again")
}

func prosrc(t *testing.T, db *sql.DB, fn string) string {
	t.Helper()
	var src string
	if err := db.QueryRowContext(context.Background(), `SELECT prosrc FROM pg_proc WHERE oid = $1::regprocedure`, fn).Scan(&src); err != nil {
		t.Fatal(err)
	}
	return src
}
