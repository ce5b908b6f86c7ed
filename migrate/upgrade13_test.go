package migrate_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// TestUpgradeTo13: from version 12 holding data, the upgrade to 13 (claim
// version 13: the new row inserted with VALUES after a probe of the holds,
// the token read before the statements that store it) keeps every answer,
// and each way a claim acquires still does on a single node: a new key, a
// key whose expired row is in the current month, a retry after a
// retryable failure, a lost lease; a key held by the inbox is answered
// in_progress; release works (it is refused only on Citus); down to 12
// restores claim version 11, and up again.
func TestUpgradeTo13(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 12); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 13")

	claim := func(key, lease string) (outcome string, attempt int, token int64) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT outcome, coalesce(attempt, 0), coalesce(token, 0) FROM idem.claim('up13', $1, lease => $2::interval)`,
			key, lease).Scan(&outcome, &attempt, &token); err != nil {
			t.Fatalf("claim %s: %v", key, err)
		}
		return outcome, attempt, token
	}
	exec := func(q string, args ...any) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Run("new key", func(t *testing.T) {
		if o, a, tok := claim("new", "1 minute"); o != "acquired" || a != 1 || tok == 0 {
			t.Fatalf("a new key: %s, attempt %d, token %d", o, a, tok)
		}
	})
	t.Run("expired row in the current month", func(t *testing.T) {
		claim("expired", "1 minute")
		exec(`UPDATE idem.processed_events SET status = 'completed', lease_expires_at = NULL, expires_at = now() - interval '1 hour' WHERE source = 'up13' AND key = 'expired'`)
		if o, a, _ := claim("expired", "1 minute"); o != "acquired" || a != 1 {
			t.Fatalf("a key whose row expired: %s, attempt %d", o, a)
		}
	})
	t.Run("retry after a retryable failure", func(t *testing.T) {
		_, _, tok := claim("retry", "1 minute")
		exec(`SELECT idem.fail('up13', 'retry', $1, 'transient', true)`, tok)
		o, a, tok2 := claim("retry", "1 minute")
		if o != "acquired" || a != 2 || tok2 == tok || tok2 == 0 {
			t.Fatalf("a retry: %s, attempt %d, token %d (was %d)", o, a, tok2, tok)
		}
	})
	t.Run("lost lease", func(t *testing.T) {
		claim("lease", "1 minute")
		exec(`UPDATE idem.processed_events SET lease_expires_at = now() - interval '1 second' WHERE source = 'up13' AND key = 'lease'`)
		if o, a, _ := claim("lease", "1 minute"); o != "acquired" || a != 2 {
			t.Fatalf("a lost lease: %s, attempt %d", o, a)
		}
	})
	t.Run("held by the inbox", func(t *testing.T) {
		exec(`INSERT INTO idem.holds (source, key, state, token, job_id, held_at) VALUES ('up13', 'held', 'queued', 1, 1, now())`)
		if o, _, _ := claim("held", "1 minute"); o != "in_progress" {
			t.Fatalf("a held key with no row: %s", o)
		}
	})
	t.Run("release", func(t *testing.T) {
		var n int64
		if err := db.QueryRowContext(ctx, `SELECT idem.release('up13', 'new')`).Scan(&n); err == nil {
			t.Fatalf("release of a key in progress: %d rows, want ID004", n)
		} else if pe := (*pgconn.PgError)(nil); !errors.As(err, &pe) || pe.Code != "ID004" {
			t.Fatalf("release of a key in progress: %v, want ID004", err)
		}
		if err := db.QueryRowContext(ctx, `SELECT idem.release('up13', 'expired')`).Scan(&n); err == nil {
			t.Fatalf("release of a key in progress: %d rows", n)
		}
		exec(`UPDATE idem.processed_events SET status = 'completed', lease_expires_at = NULL WHERE source = 'up13' AND key = 'retry'`)
		if err := db.QueryRowContext(ctx, `SELECT idem.release('up13', 'retry')`).Scan(&n); err != nil || n != 1 {
			t.Fatalf("release of a completed key: %d rows, %v", n, err)
		}
	})

	if _, err := p.DownTo(ctx, 12); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 12")
	var src string
	if err := db.QueryRowContext(ctx, `SELECT prosrc FROM pg_proc WHERE oid = 'idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure`).Scan(&src); err != nil || !strings.Contains(src, "WHERE NOT EXISTS") || strings.Contains(src, "version 13") {
		t.Fatalf("claim after down to 12 is not version 11 (%v)", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 13 again")
}
