package idem_test

import (
	"context"
	"database/sql"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestOldSchema: the library against a schema migrated only to version 10
// (code deployed before `migrate up`) refuses to claim with ErrNotMigrated,
// before any work runs, on pgx and database/sql. Migrated down while a
// client runs (its check passed), the work that ran is still recorded
// (with version 1's idem.complete), the next delivery is refused before
// the work, and after `migrate up` the key answers as completed. Before,
// the work ran and could not be recorded (idem.complete_stored missing):
// the key stayed processing and every delivery after the lease ran it.
func TestOldSchema(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	pool := testdb.Pool(t, url, 4)
	running := testdb.Client(t, pool, nil)
	if _, err := running.Claim(ctx, "old", "warm-up"); err != nil { // its check passes now
		t.Fatal(err)
	}
	if _, err := migrate.DownTo(ctx, db, 10, false); err != nil {
		t.Fatal(err)
	}
	runs := 0
	work := func(context.Context) (any, error) { runs++; return map[string]int{"n": 1}, nil }

	for name, c := range map[string]*idem.Client{"pgx": testdb.Client(t, pool, nil), "database/sql": testdb.SQLClient(t, db, nil)} {
		for range 3 {
			if _, err := c.Do(ctx, "old", "new-client-"+name, work); !errors.Is(err, idem.ErrNotMigrated) {
				t.Fatalf("%s on version 10: %v, want ErrNotMigrated", name, err)
			}
		}
	}
	if runs != 0 {
		t.Fatalf("the work ran %d times on a schema the client cannot record it in", runs)
	}

	// The client that checked at the latest version: the work runs once
	// and is recorded; then the schema is checked again.
	if res, err := running.Do(ctx, "old", "running", work); err != nil || string(res.Result) != `{"n":1}` {
		t.Fatalf("migrated down under a running client: %+v %v", res, err)
	}
	if _, err := running.Do(ctx, "old", "running", work); !errors.Is(err, idem.ErrNotMigrated) {
		t.Fatalf("next delivery: %v, want ErrNotMigrated", err)
	}
	if runs != 1 {
		t.Fatalf("the work ran %d times", runs)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	res, err := running.Do(ctx, "old", "running", work)
	if err != nil || !res.Replayed || runs != 1 {
		t.Fatalf("after migrate up: %+v %v, ran %d times", res, err, runs)
	}
}

// TestDuplicatesReadOnly: on a connection whose transactions are read-only
// (as on a hot standby), every duplicate of a completed key is answered
// from the stored result, with the duplicate counter sampling each one
// (migration 16). Before, each sampled duplicate (one in eight by default)
// failed with 25006.
func TestDuplicatesReadOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('ro', '1 day', '1 minute', 1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := testdb.Client(t, pool, nil).Do(ctx, "ro", "k", func(context.Context) (any, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	ro, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ro.Close)
	standby := testdb.Client(t, ro, nil)
	for range 50 {
		res, err := standby.Do(ctx, "ro", "k", func(context.Context) (any, error) { return nil, errors.New("ran on the standby") })
		if err != nil || !res.Replayed || string(res.Result) != "1" {
			t.Fatalf("read-only duplicate: %+v %v", res, err)
		}
	}
}

// TestDuplicatesReadOnlyLongTTL: a duplicate of a completed key claimed
// with a ttl above the source's lookback (idem.claim and idem.claim_batch)
// in a read-only transaction, as on a hot standby, is answered completed
// from its stored result. Before migration 24 idem.raise_lookback wrote the
// raised lookback first and the claim failed with 25006.
func TestDuplicatesReadOnlyLongTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('ro-ttl', '1 day', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := testdb.Client(t, pool, nil).Do(ctx, "ro-ttl", "k", func(context.Context) (any, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SELECT outcome || ' ' || result::text FROM idem.claim('ro-ttl', 'k', ttl => '400 days')`,
		`SELECT string_agg(outcome || ' ' || result::text, ',') FROM idem.claim_batch('ro-ttl', ARRAY['k', 'k'], ttl => '400 days')`,
	} {
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		var got string
		err = tx.QueryRow(ctx, q).Scan(&got)
		_ = tx.Rollback(ctx)
		if err != nil || (got != "completed 1" && got != "completed 1,completed 1") {
			t.Errorf("%s, read-only: %q %v, want completed from the stored result", q, got, err)
		}
	}
}

// TestDuplicatesOnStandby: on a real hot standby (streaming replication
// from a primary of its own), every duplicate of a completed key is
// answered from its stored result, with the duplicate counter sampling
// each one (migration 16), and a new key is refused, not run. Before, each
// sampled duplicate (one in eight by default) failed with 25006.
// A duplicate claimed with a ttl above the source's lookback is answered
// too (migration 24; before, idem.raise_lookback's insert failed it).
func TestDuplicatesOnStandby(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Stop)
	db, err := sql.Open("pgx", primary.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('ro', '1 day', '1 minute', 1)`); err != nil {
		t.Fatal(err)
	}
	if _, err := testdb.SQLClient(t, db, nil).Do(ctx, "ro", "k", func(context.Context) (any, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	standby, err := primary.Standby(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Stop)
	pool := testdb.Pool(t, standby.URL("postgres"), 2)
	var inRecovery bool
	if err := pool.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery); err != nil || !inRecovery {
		t.Fatalf("not a standby: %v %v", inRecovery, err)
	}
	c := testdb.Client(t, pool, nil)
	for range 50 {
		res, err := c.Do(ctx, "ro", "k", func(context.Context) (any, error) { return nil, errors.New("ran on the standby") })
		if err != nil || !res.Replayed || string(res.Result) != "1" {
			t.Fatalf("duplicate on the standby: %+v %v", res, err)
		}
	}
	// A ttl above the source's lookback (migration 24): answered, not
	// 25006 from the lookback's insert.
	var long string
	if err := pool.QueryRow(ctx, `SELECT outcome || ' ' || result::text FROM idem.claim('ro', 'k', ttl => '400 days')`).Scan(&long); err != nil || long != "completed 1" {
		t.Fatalf("duplicate on the standby with a ttl above the lookback: %q %v", long, err)
	}
	ran := false
	if _, err := c.Do(ctx, "ro", "new", func(context.Context) (any, error) { ran = true; return 1, nil }); err == nil || ran {
		t.Fatalf("a new key on the standby: ran %v, %v", ran, err)
	}
	// SERIALIZABLE (migration 32's placeholders read pg_control_checkpoint(),
	// which on a standby is its last restartpoint): PostgreSQL refuses
	// serializable mode in a hot standby before any of idem runs, whether
	// the transaction asks for it or the session's default does; the claim
	// fails (0A000), nothing runs.
	for _, set := range []string{"", "SET default_transaction_isolation = 'serializable'"} {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if set != "" {
			if _, err := conn.Exec(ctx, set); err != nil {
				t.Fatal(err)
			}
		}
		for _, key := range []string{"k", "new-ser"} {
			ran := false
			err := pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
				_, err := c.WithTx(tx).Do(ctx, "ro", key, func(context.Context) (any, error) { ran = true; return 1, nil })
				return err
			})
			if set != "" {
				err = errors.Join(err, conn.QueryRow(ctx, `SELECT outcome FROM idem.claim('ro', $1)`, key).Scan(new(string)))
			}
			var pg *pgconn.PgError
			if ran || !errors.As(err, &pg) || pg.Code != "0A000" {
				t.Errorf("%q SERIALIZABLE claim of %s on the standby: ran %v, %v, want 0A000", set, key, ran, err)
			}
		}
		conn.Release()
	}
}
