package migrate_test

import (
	"context"
	"database/sql"
	"testing"
)

// TestUpgradeTo21: from version 20 holding data, the upgrade to 21 keeps
// every answer. A SERIALIZABLE transaction whose snapshot predates a claim
// of its key committed into the previous month's partition (as a claim
// whose clock was on the other side of the month boundary commits it) no
// longer acquires the key again: version 20 answers "acquired" (the work
// would run twice), version 21 fails with 40001 and the retried
// transaction is answered "completed". Down to 20 brings the old answer
// back; up again.
func TestUpgradeTo21(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 20); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('sm', '90 days', '1 minute');
		SELECT idem.create_partition((date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date)`); err != nil {
		t.Fatal(err)
	}
	// race claims key k in a SERIALIZABLE transaction whose snapshot is
	// taken before another session commits k's row into the previous
	// month, completed.
	race := func(k string) (outcome string, err error) {
		t.Helper()
		tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		// The snapshot first, under a session as hostile as a deployment's
		// can be: another DateStyle and a time zone far from UTC.
		if _, err := tx.ExecContext(ctx, `SET LOCAL DateStyle = 'SQL, DMY'; SET LOCAL TimeZone = 'Pacific/Chatham'; SELECT 1`); err != nil {
			t.Fatal(err)
		}
		if _, err := db.ExecContext(ctx, `INSERT INTO idem.processed_events
			(source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at, result)
			VALUES ('sm', $1, (date_trunc('month', now() AT TIME ZONE 'UTC') - interval '1 month')::date,
			        'completed', 1, 1, now(), now(), now() + interval '30 days', '{"done":true}')`, k); err != nil {
			t.Fatal(err)
		}
		err = tx.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('sm', $1)`, k).Scan(&outcome)
		return outcome, err
	}
	if outcome, err := race("v20"); err != nil || outcome != "acquired" {
		t.Fatalf("version 20: %q %v, want the duplicate acquired (the old defect)", outcome, err)
	}

	if _, err := p.UpTo(ctx, 21); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 21")
	if outcome, err := race("v21"); !isCode(err, "40001") {
		t.Fatalf("version 21: %q %v, want a serialization failure", outcome, err)
	}
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('sm', 'v21')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("version 21, retried: %q %v, want completed", outcome, err)
	}
	var placeholders int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.processed_events WHERE token = 0`).Scan(&placeholders); err != nil || placeholders != 0 {
		t.Fatalf("%d placeholder rows left (%v)", placeholders, err)
	}

	if _, err := p.DownTo(ctx, 20); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 20")
	if outcome, err := race("down"); err != nil || outcome != "acquired" {
		t.Fatalf("down to 20: %q %v, want version 20's answer", outcome, err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
}
