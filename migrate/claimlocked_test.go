package migrate_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"
)

// TestClaimLockedCut (migrations 29 and 30, on a single node): the
// statement that Citus's claim_locked is made from is found in
// idem.claim_batch by its marker comments, so a rewrite of the batch that
// loses it fails here and not only in the opt-in Citus suite.
// idem.citus_claim_locked_definition makes a claim_locked; made here on
// the single node's own tables it answers locked keys (new, completed, in
// flight, a fingerprint mismatch) as idem.claim_batch answers them (its
// columns are the batch's loop's, the month of a row read from it last);
// with a marker gone, a marker twice, or a statement that names another
// variable or parameter of the batch, no definition is made.
func TestClaimLockedCut(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 30); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	for _, q := range []string{
		`SELECT idem.claim('up', 'running', lease => '1 hour')`,
		`SELECT idem.claim('up', 'fp', 'a')`,
		`SELECT idem.complete('up', 'fp', (SELECT token FROM idem.processed_events WHERE source = 'up' AND key = 'fp'), '2')`,
		`CREATE SCHEMA idem_cut_test`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var def sql.NullString
	if err := db.QueryRowContext(ctx, `SELECT idem.citus_claim_locked_definition('idem_cut_test')`).Scan(&def); err != nil || !def.Valid {
		t.Fatalf("no claim_locked definition from idem.claim_batch (%v)", err)
	}
	if _, err := db.ExecContext(ctx, def.String); err != nil {
		t.Fatalf("the claim_locked definition: %v", err)
	}

	keys := []string{"new-1", "done-1", "running", "fp", "new-2"}
	const fps = `ARRAY[NULL, NULL, NULL, 'b', NULL]::text[]`
	const cols = `concat_ws(' ', ord, outcome, token IS NOT NULL, attempt, result, error, first_seen IS NOT NULL,
		expires_at IS NOT NULL, lease_remaining IS NOT NULL)`
	// answers runs q (the keys' answers as text, in order) in a
	// transaction rolled back.
	answers := func(q string) string {
		t.Helper()
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback()
		var got string
		if err := tx.QueryRowContext(ctx, q, keys).Scan(&got); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		return got
	}
	batch := answers(`SELECT string_agg(` + cols + `, '; ' ORDER BY ord) FROM idem.claim_batch('up', $1, ` + fps + `)`)
	locked := answers(`WITH v AS (
		SELECT idem.clock() AS now, (SELECT max(l.lookback) FROM idem.lookbacks l) AS lookback,
		       (SELECT p.ttl FROM idem.policies p WHERE p.source = '*') AS ttl,
		       (SELECT p.lease FROM idem.policies p WHERE p.source = '*') AS lease)
		SELECT string_agg(` + cols + ` || ' month=' || (c.month IS NOT NULL), '; ' ORDER BY ord)
		  FROM v, idem_cut_test.claim_locked('up', $1, ` + fps + `, NULL, ARRAY[1, 2, 3, 4, 5], v.now,
		       idem.window_start(v.now, v.lookback), idem.utc_month(v.now + interval '1 day'), idem.utc_month(v.now),
		       v.ttl, v.lease, false, true, idem.new_token()) c`)
	const want = "1 acquired t 1 t t t month=false; " +
		"2 completed f 1 {\"v\": 1} t t f month=true; " +
		"3 in_progress f 1 t t t month=true; " +
		"4 mismatch f 1 t t f month=true; " +
		"5 acquired t 1 t t t month=false"
	if locked != want {
		t.Fatalf("claim_locked answered\n%s\nwant\n%s", locked, want)
	}
	if want := strings.NewReplacer(" month=true", "", " month=false", "").Replace(want); batch != want {
		t.Fatalf("claim_batch answered\n%s\nwant\n%s", batch, want)
	}

	// Each edit of idem.claim_batch (in a transaction rolled back) that
	// leaves no statement to cut: no definition.
	for name, edit := range map[string]string{
		"begin marker gone":  `replace(d, '-- <claim_locked>', '-- claim_locked')`,
		"end marker gone":    `replace(d, '-- </claim_locked>', '-- /claim_locked')`,
		"begin marker twice": `replace(d, '-- </claim_locked>', '-- </claim_locked>' || chr(10) || '            -- <claim_locked>')`,
		"another variable":   `replace(d, 'WHERE v_holds AND y.source', 'WHERE v_short AND y.source')`,
		"another parameter":  `replace(d, 'claim_batch.event_types[p.o]', 'claim_batch.event_types[p.o] || claim_batch.lease::text')`,
	} {
		t.Run(name, func(t *testing.T) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback()
			if _, err := tx.ExecContext(ctx, `DO $$ DECLARE d text := pg_get_functiondef('idem.claim_batch(text, text[], text[], interval, interval, text[], interval)'::regprocedure);
				BEGIN IF `+edit+` = d THEN RAISE 'the edit changed nothing'; END IF; EXECUTE `+edit+`; END $$`); err != nil {
				t.Fatal(err)
			}
			var got sql.NullString
			if err := tx.QueryRowContext(ctx, `SELECT idem.citus_claim_locked_definition('idem_cut_test')`).Scan(&got); err != nil || got.Valid {
				t.Fatalf("a definition from the edited batch (%v):\n%.200s", err, got.String)
			}
		})
	}
}
