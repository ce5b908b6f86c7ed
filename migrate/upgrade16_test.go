package migrate_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestUpgradeTo16: from version 15 holding data, the upgrade to 16
// (count_duplicate version 16) keeps every answer, and a read-only
// transaction (as on a hot standby) answers every duplicate of a completed
// key, with the counter sampling each one, counting none; a read-write one
// still counts. Down to 15 restores version 15's counter, which fails such
// a claim with 25006 (before: one duplicate in eight on a standby), and up
// again.
func TestUpgradeTo16(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 15); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('ro', '1 day', '1 minute', 1);
		SELECT outcome FROM idem.claim('ro', 'k'); UPDATE idem.processed_events SET status = 'completed', lease_expires_at = NULL WHERE source = 'ro'`); err != nil {
		t.Fatal(err)
	}
	// readOnly claims the completed key 20 times in a read-only transaction.
	readOnly := func() error {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		for range 20 {
			var outcome string
			if err := tx.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('ro', 'k')`).Scan(&outcome); err != nil {
				return err
			}
			if outcome != "completed" {
				t.Fatalf("read-only duplicate: %s", outcome)
			}
		}
		return nil
	}
	counted := func() (n int64) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'ro'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if err := readOnly(); !isCode(err, "25006") {
		t.Fatalf("version 15, read-only: %v, want 25006", err)
	}

	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 16")
	before := counted()
	if err := readOnly(); err != nil {
		t.Fatalf("version 16, read-only: %v", err)
	}
	if counted() != before {
		t.Fatal("a read-only duplicate was counted")
	}
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('ro', 'k')`); err != nil || counted() != before+1 {
		t.Fatalf("version 16, read-write: %v, counted %d, want %d", err, counted(), before+1)
	}

	if _, err := p.DownTo(ctx, 15); err != nil {
		t.Fatal(err)
	}
	if err := readOnly(); !isCode(err, "25006") {
		t.Fatalf("down to 15, read-only: %v, want 25006", err)
	}
	seededAnswered(t, db, "down to 15")
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if err := readOnly(); err != nil {
		t.Fatalf("up again: %v", err)
	}
}

func isCode(err error, code string) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == code
}
