package migrate_test

import (
	"context"
	"database/sql"
	"testing"

	"github.com/idemkit/idem/migrate"
)

// citusShortVersion is the migration that answers a delegated claim on
// Citus by idem.claim's short path on the key's shard.
const citusShortVersion = 34

// TestClaimShortCut (migration 34): on a single node, the short path's copy
// that idem.citus_claim_short_definition cuts from idem.claim (what each
// shard gets on Citus, here on idem's own tables) answers every state as
// idem.claim does (a new key, a completed one, one in progress, a
// fingerprint mismatch, a failed one that idem.claim_general takes over, a
// queued hold); a policy inserted and then changed is seen by the very next
// claim through the copy, and so is an adoption in progress (the claim goes
// to idem.claim_general, which adopts the key from the legacy table); and
// an edit of idem.claim that leaves a block's markers missing or doubled
// gives no definition.
func TestClaimShortCut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, citusShortVersion); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	for _, q := range []string{
		`SELECT idem.claim('up', 'running', lease => '1 hour')`,
		`SELECT idem.claim('up', 'fp', 'a')`,
		`SELECT idem.complete('up', 'fp', (SELECT token FROM idem.processed_events WHERE source = 'up' AND key = 'fp'), '2')`,
		`SELECT idem.claim('up', 'failed')`,
		`SELECT idem.fail('up', 'failed', (SELECT token FROM idem.processed_events WHERE source = 'up' AND key = 'failed'), 'boom', true)`,
		`INSERT INTO idem.holds (source, key, token, held_at) VALUES ('up', 'held', 1, now())`,
		`CREATE SCHEMA idem_cut_test`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var def sql.NullString
	if err := db.QueryRowContext(ctx, `SELECT idem.citus_claim_short_definition('idem_cut_test', 'idem.claim_general')`).Scan(&def); err != nil || !def.Valid {
		t.Fatalf("no definition of the short path's copy from idem.claim (%v)", err)
	}
	if _, err := db.ExecContext(ctx, def.String); err != nil {
		t.Fatalf("the copy's definition: %v", err)
	}

	// answers: each key's answer by fn, as text, in a transaction rolled
	// back (lease_remaining to the minute: the two read the clock apart).
	answers := func(fn string) string {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		var got string
		if err := tx.QueryRowContext(ctx, `SELECT string_agg(concat_ws(' ', k.key, c.outcome, c.token IS NOT NULL, c.attempt, c.result, c.error,
				c.expires_at - c.first_seen, date_trunc('minute', c.lease_remaining)), '; ' ORDER BY k.o)
			  FROM unnest(ARRAY['new-1', 'done-1', 'running', 'fp', 'failed', 'held', 'new-2']) WITH ORDINALITY k(key, o),
			       LATERAL `+fn+`('up', k.key, CASE k.key WHEN 'fp' THEN 'b' END) c`).Scan(&got); err != nil {
			t.Fatalf("%s: %v", fn, err)
		}
		return got
	}
	claim, cut := answers("idem.claim"), answers("idem_cut_test.claim")
	if cut != claim {
		t.Fatalf("the copy answered\n%s\nidem.claim\n%s", cut, claim)
	}
	t.Logf("both answered %s", claim)

	t.Run("settings changed", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		ttl := func(key, want string) {
			t.Helper()
			var got string
			if err := tx.QueryRowContext(ctx, `SELECT (expires_at - first_seen)::text FROM idem_cut_test.claim('pol', $1)`, key).Scan(&got); err != nil || got != want {
				t.Fatalf("%s: ttl %q (%v), want %s", key, got, err, want)
			}
		}
		for _, s := range []struct{ q, key, want string }{
			{`INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('pol', '2 days', '30 seconds', 0)`, "k1", "2 days"},
			{`UPDATE idem.policies SET ttl = '3 days' WHERE source = 'pol'`, "k2", "3 days"},
			{`DELETE FROM idem.policies WHERE source = 'pol'`, "k3", ""},
		} {
			if _, err := tx.ExecContext(ctx, s.q); err != nil {
				t.Fatal(err)
			}
			if s.want == "" { // the default's ttl
				if err := tx.QueryRowContext(ctx, `SELECT ttl::text FROM idem.policies WHERE source = '*'`).Scan(&s.want); err != nil {
					t.Fatal(err)
				}
			}
			ttl(s.key, s.want)
		}
	})

	t.Run("adoption", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		// A legacy table being adopted that holds the key: the copy
		// answers it completed, adopted by idem.claim_general.
		for _, q := range []string{
			`CREATE TABLE public.legacy_cut (k text PRIMARY KEY, at timestamptz)`,
			`INSERT INTO public.legacy_cut VALUES ('old-1', now())`,
			`INSERT INTO idem.adoptions (source, legacy, key_column, at_column, ttl) VALUES ('up', 'public.legacy_cut', 'k', 'at', '20 days')`,
		} {
			if _, err := tx.ExecContext(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		var outcome string
		if err := tx.QueryRowContext(ctx, `SELECT outcome FROM idem_cut_test.claim('up', 'old-1')`).Scan(&outcome); err != nil || outcome != "completed" {
			t.Fatalf("a key of the legacy table being adopted: %q (%v), want completed", outcome, err)
		}
	})

	// Each edit of idem.claim (rolled back) that leaves a block's markers
	// missing or doubled: no definition.
	for name, edit := range map[string]string{
		"dispatch begin gone":   `replace(d, '-- <citus_dispatch>', '-- citus_dispatch')`,
		"dispatch end gone":     `replace(d, '-- </citus_dispatch>', '-- /citus_dispatch')`,
		"settings begin gone":   `replace(d, '-- <claim_settings>', '-- claim_settings')`,
		"settings end twice":    `replace(d, '-- </claim_settings>', '-- </claim_settings>' || chr(10) || '    -- </claim_settings>')`,
		"settings read outside": `replace(d, '-- </claim_settings>', '-- </claim_settings>' || chr(10) || '    PERFORM idem.claim_settings_refresh(claim.source);')`,
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			if _, err := tx.ExecContext(ctx, `DO $$ DECLARE d text := pg_get_functiondef('idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure);
				BEGIN IF `+edit+` = d THEN RAISE 'the edit changed nothing'; END IF; EXECUTE `+edit+`; END $$`); err != nil {
				t.Fatal(err)
			}
			var got sql.NullString
			if err := tx.QueryRowContext(ctx, `SELECT idem.citus_claim_short_definition('idem_cut_test', 'idem.claim_general')`).Scan(&got); err != nil || got.Valid {
				t.Fatalf("a definition from the edited claim (%v):\n%.200s", err, got.String)
			}
		})
	}
}

// TestUpgradeToCitusShort (migration 34): from version 32 holding data,
// the upgrade keeps every answer on a single node and idem.claim's
// statements (only its Citus part moved into a block of its own); down
// restores version 32's idem.claim and drops the new functions; up again.
func TestUpgradeToCitusShort(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, citusShortVersion-1); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	state := func(stage string, want bool) {
		t.Helper()
		var n int
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_proc WHERE pronamespace = 'idem'::regnamespace
			AND proname IN ('citus_claim_local', 'citus_claim_local_definition', 'citus_claim_short_definition')`).Scan(&n); err != nil || (n == 3) != want {
			t.Fatalf("%s: %d of the new functions (%v), want them: %v", stage, n, err, want)
		}
		var marked bool
		if err := db.QueryRowContext(ctx, `SELECT prosrc LIKE '%-- <citus_dispatch>%' FROM pg_proc
			WHERE oid = 'idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure`).Scan(&marked); err != nil || marked != want {
			t.Fatalf("%s: idem.claim's Citus block: %v (%v), want %v", stage, marked, err, want)
		}
	}
	if _, err := p.UpTo(ctx, citusShortVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade")
	state("after the upgrade", true)
	if _, err := p.DownTo(ctx, citusShortVersion-1); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down")
	state("down", false)
	if _, err := p.UpTo(ctx, citusShortVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
	state("up again", true)
	if v := migrate.Latest(); v < citusShortVersion {
		t.Fatalf("latest version %d", v)
	}
}

// TestUpgradeFrom32EveryState: the every-state fixture at version 32
// migrated up to the latest version (migration 33's checkpoint fallback,
// migration 34's idem.claim): every key answers as before.
func TestUpgradeFrom32EveryState(t *testing.T) { testUpgradeEveryState(t, 32) }
