package migrate_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestUpgradeTo4: an installation at version 3 holding keys in several
// months (completed, failed, leased, and one claimed through version 3's
// idem.claim) and an application role is upgraded to version 4: every old
// key answers as before, the leased one completes with its old token, the
// role keeps its rights on the new claim; down to 3 and up again keeps it all.
func TestUpgradeTo4(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	role := fmt.Sprintf("idem_upgrade_app_%d", time.Now().UnixNano())
	if _, err := db.ExecContext(ctx, `CREATE ROLE `+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), `DROP OWNED BY `+role)
		_, _ = db.ExecContext(context.Background(), `DROP ROLE `+role)
	})
	now := time.Now().UTC()
	month := func(add int) time.Time { return testdb.MonthStart(now, add) }
	var leasedToken int64
	if _, err := db.ExecContext(ctx, `SELECT idem.grant_app($1::regrole)`, role); err != nil {
		t.Fatal(err)
	}
	for _, m := range []time.Time{month(-2), month(-1)} {
		if _, err := db.ExecContext(ctx, `SELECT idem.create_partition($1::date)`, m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := db.ExecContext(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, result, last_error, retryable, first_seen, updated_at, expires_at)
		VALUES ('up', 'done-2', $1::date, 'completed', nextval('idem.token_seq'), NULL, '{"v": 2}', NULL, NULL, $1::date + interval '1 day', now(), now() + interval '30 days'),
		       ('up', 'failed-1', $2::date, 'failed', nextval('idem.token_seq'), NULL, NULL, 'card declined', false, $2::date + interval '1 day', now(), now() + interval '30 days'),
		       ('up', 'leased-1', $2::date, 'processing', nextval('idem.token_seq'), now() + interval '1 hour', NULL, NULL, NULL, $2::date + interval '1 day', now(), now() + interval '30 days')`,
		month(-2), month(-1)); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, `SELECT token FROM idem.claim('up', 'v3-claimed')`).Scan(&leasedToken); err != nil {
		t.Fatal(err)
	}

	check := func(t *testing.T, stage string) {
		t.Helper()
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		defer pool.Close()
		c := idem.New(pool, nil)
		if cl, err := c.Claim(ctx, "up", "done-2"); err != nil || cl.Outcome != idem.Completed || string(cl.Result) != `{"v": 2}` {
			t.Fatalf("%s: a key completed two months ago: %+v %v", stage, cl, err)
		}
		if cl, err := c.Claim(ctx, "up", "failed-1"); err != nil || cl.Outcome != idem.Failed || cl.Error != "card declined" {
			t.Fatalf("%s: a failed key: %+v %v", stage, cl, err)
		}
		if cl, err := c.Claim(ctx, "up", "leased-1"); err != nil || cl.Outcome != idem.InProgress || cl.LeaseRemaining < 50*time.Minute {
			t.Fatalf("%s: a leased key: %+v %v", stage, cl, err)
		}
		var ok bool
		if err := pool.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.claim(text,text,text,interval,interval,text,interval)', 'EXECUTE')
		                                   AND has_function_privilege($1, 'idem.complete_unstored(text,text,bigint,text)', 'EXECUTE')
		                                   AND NOT has_function_privilege($1, 'idem.prune_batch(text,integer)', 'EXECUTE')`, role).Scan(&ok); err != nil || !ok {
			t.Fatalf("%s: the application role's rights: %v %v", stage, ok, err)
		}
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	check(t, "after the upgrade")
	{
		pool, err := pgxpool.New(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		c := idem.New(pool, nil)
		if err := c.Complete(ctx, "up", "v3-claimed", leasedToken, json.RawMessage(`{"v": 3}`)); err != nil {
			t.Fatalf("completing a version-3 claim with its token: %v", err)
		}
		pool.Close()
	}

	if _, err := p.DownTo(ctx, 3); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'done-2')`).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("version 3 again: %q %v", outcome, err)
	}
	var ok bool
	if err := db.QueryRowContext(ctx, `SELECT has_function_privilege($1, 'idem.claim(text,text,text,interval,interval,text)', 'EXECUTE')`, role).Scan(&ok); err != nil || !ok {
		t.Fatalf("down to 3: the role lost its right on claim: %v %v", ok, err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	check(t, "down and up again")
}
