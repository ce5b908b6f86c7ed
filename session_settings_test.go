package idem_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testdb"
)

// TestSessionSettingsCarriedOver: the session settings idem's functions
// read, set at session level by the application's role (any role can, and
// a transaction-mode pooler carries them to the next client of the server
// connection), change nothing for the claims that follow.
//
// idem.citus = on: claims of new keys and duplicates, in READ COMMITTED and
// SERIALIZABLE, a claim that meets another's lock (idem.claim_general), and
// a batch are answered as without it (without Citus' catalog the setting
// is ignored). Before migration 30, every claim failed with 42883.
//
// idem.uncounted, which a waiting duplicate's transaction sets so that its
// second claim is not counted again, set to 'on' or to the mark of a
// transaction that ended: every duplicate is still counted. Before
// migration 29, none was. The mark of the claim's own transaction (what
// WithWait sets) still keeps its duplicate uncounted.
func TestSessionSettingsCarriedOver(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	role := fmt.Sprintf("uncounted_app_%d", time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN; SELECT idem.grant_app('`+role+`')`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role)
	})
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SET ROLE `+role+`; SELECT set_config('idem.citus', 'on', false)`); err != nil {
		t.Fatal(err)
	}
	claim := func(t *testing.T, tx pgx.Tx, key, want string) {
		t.Helper()
		var q interface {
			QueryRow(context.Context, string, ...any) pgx.Row
		} = conn
		if tx != nil {
			q = tx
		}
		var outcome string
		if err := q.QueryRow(ctx, `SELECT outcome FROM idem.claim('s', $1)`, key).Scan(&outcome); err != nil || outcome != want {
			t.Fatalf("claim %s: %q %v, want %s", key, outcome, err, want)
		}
	}
	var outcome, done string
	if err := conn.QueryRow(ctx, `SELECT c.outcome, idem.complete('s', 'k1', c.token, '1') FROM idem.claim('s', 'k1') c`).Scan(&outcome, &done); err != nil ||
		outcome != "acquired" || done != "completed" {
		t.Fatalf("claim and complete k1 with idem.citus = on in the session: %q %q %v", outcome, done, err)
	}
	t.Run("idem.citus", func(t *testing.T) {
		claim(t, nil, "k1", "completed")
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		claim(t, tx, "k2", "acquired")
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		claim(t, nil, "k2", "in_progress")
		// Another connection holds k3's lock in an open transaction: the
		// claim goes to idem.claim_general, which waits and answers.
		other, err := admin.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := other.Exec(ctx, `SELECT pg_advisory_xact_lock(1768187245, hashtext('s' || chr(31) || 'k3'))`); err != nil {
			t.Fatal(err)
		}
		var got string
		err = conn.QueryRow(ctx, `SELECT outcome FROM idem.claim('s', 'k3', lock_wait => '50 milliseconds')`).Scan(&got)
		_ = other.Rollback(ctx)
		if err != nil || got != "in_progress" {
			t.Fatalf("a claim meeting another's lock with idem.citus = on in the session: %q %v, want in_progress", got, err)
		}
		claim(t, nil, "k3", "acquired")
		rows, err := conn.Query(ctx, `SELECT outcome FROM idem.claim_batch('s', ARRAY['k1', 'k4']) ORDER BY ord`)
		if err != nil {
			t.Fatal(err)
		}
		outs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(outs) != 2 || outs[0] != "completed" || outs[1] != "acquired" {
			t.Fatalf("a batch of k1 (completed) and k4 (new) with idem.citus = on in the session: %v %v", outs, err)
		}
		var setting string
		if err := conn.QueryRow(ctx, `SELECT current_setting('idem.citus')`).Scan(&setting); err != nil || setting != "on" {
			t.Fatalf("the session's own setting: %q %v", setting, err)
		}
	})
	t.Run("uncounted", func(t *testing.T) {
		counted := func() (n int64) {
			t.Helper()
			if err := admin.QueryRow(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 's'`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		var lastMark string
		if err := conn.QueryRow(ctx, `SELECT now()::text`).Scan(&lastMark); err != nil {
			t.Fatal(err)
		}
		for _, left := range []string{"on", lastMark} {
			before := counted()
			if _, err := conn.Exec(ctx, `SELECT set_config('idem.uncounted', $1, false)`, left); err != nil {
				t.Fatal(err)
			}
			for range 5 {
				claim(t, nil, "k1", "completed")
			}
			if got := counted() - before; got != 5 {
				t.Errorf("idem.uncounted = %q left in the session: 5 duplicates counted %d times, want 5", left, got)
			}
		}
		// The claim's own transaction marked, as WithWait does: not counted.
		before := counted()
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		if _, err := tx.Exec(ctx, `SELECT pg_catalog.set_config('idem.uncounted', pg_catalog.now()::pg_catalog.text, true)`); err != nil {
			t.Fatal(err)
		}
		claim(t, tx, "k1", "completed")
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got := counted() - before; got != 0 {
			t.Errorf("a duplicate in a transaction marked uncounted: counted %d times, want 0", got)
		}
	})
}
