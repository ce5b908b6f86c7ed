package migrate_test

import (
	"context"
	"database/sql"
	"testing"
)

// sessionSettingsVersion is the migration that gives idem.claim and
// idem.claim_batch SET idem.citus = off on a single node.
const sessionSettingsVersion = 29

// TestUpgradeToSessionSettings: from the version before, holding data,
// the upgrade gives idem.claim and idem.claim_batch SET idem.citus = off
// (a session's idem.citus no longer reaches them) and idem.count_duplicate
// the transaction's start time as its idem.uncounted mark, and keeps every answer;
// down removes the clauses and keeps every answer; up again. The
// behaviour: idem_test.TestSessionSettingsCarriedOver.
func TestUpgradeToSessionSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, sessionSettingsVersion-1); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	pinned := func(stage string, want int) {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_proc
			WHERE oid IN ('idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure,
			              'idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure)
			  AND 'idem.citus=off' = ANY (proconfig)`).Scan(&n); err != nil || n != want {
			t.Fatalf("%s: %d of claim and claim_batch have idem.citus=off, want %d (%v)", stage, n, want, err)
		}
		var marked bool
		if err := db.QueryRowContext(ctx, `SELECT prosrc LIKE '%pg_catalog.now()::pg_catalog.text%' FROM pg_proc
			WHERE oid = 'idem.count_duplicate(text, text, date, integer, boolean, timestamptz)'::regprocedure`).Scan(&marked); err != nil || marked != (want > 0) {
			t.Fatalf("%s: idem.count_duplicate takes the transaction's start time as the mark: %v, want %v (%v)", stage, marked, want > 0, err)
		}
	}
	claimsWithCitusOn := func(stage string, key string, ok bool) {
		t.Helper()
		conn, err := db.Conn(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		var outcome sql.NullString
		err = conn.QueryRowContext(ctx, `SELECT c.outcome FROM (SELECT set_config('idem.citus', 'on', false)) s, idem.claim('up', $1) c`, key).Scan(&outcome)
		if _, rerr := conn.ExecContext(ctx, `RESET idem.citus`); rerr != nil {
			t.Fatal(rerr)
		}
		if ok != (err == nil && outcome.String == "acquired") {
			t.Fatalf("%s: a claim with idem.citus = on in the session: %q %v (answered: %v)", stage, outcome.String, err, ok)
		}
	}
	if _, err := p.UpTo(ctx, sessionSettingsVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade")
	pinned("after the upgrade", 2)
	claimsWithCitusOn("after the upgrade", "new-1", true)
	if _, err := p.DownTo(ctx, sessionSettingsVersion-1); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down")
	pinned("down", 0)
	claimsWithCitusOn("down", "new-2", false)
	if _, err := p.UpTo(ctx, sessionSettingsVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
	pinned("up again", 2)
}
