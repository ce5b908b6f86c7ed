package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestCitusRefused is part of the opt-in Citus suite (docs/citus.md): it
// runs when IDEM_TEST_CITUS_URL names a database on a Citus coordinator
// whose workers are added, and says it did not run, and why, otherwise.
// On a distributed idem the inbox refuses to accept and to replay with
// ErrCitus and writes nothing: no job, no hold, no key.
func TestCitusRefused(t *testing.T) {
	url := testdb.Citus(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		t.Error("a handler ran on Citus")
		return nil, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "citus-1", Payload: []byte(`{}`)}); !errors.Is(err, inbox.ErrCitus) {
		t.Fatalf("Accept on Citus: %v, want ErrCitus", err)
	}
	if _, err := in.Replay(ctx, inbox.Filter{Source: "shop"}); !errors.Is(err, inbox.ErrCitus) {
		t.Fatalf("Replay on Citus: %v, want ErrCitus", err)
	}
	var jobs, holds, keys int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM river_job WHERE kind = $1 AND args->>'key' = 'citus-1'),
		(SELECT count(*) FROM idem.holds), (SELECT count(*) FROM idem.processed_events WHERE key = 'citus-1')`, inbox.Kind).Scan(&jobs, &holds, &keys); err != nil {
		t.Fatal(err)
	}
	if jobs+holds+keys != 0 {
		t.Fatalf("after the refused accept: %d jobs, %d holds, %d keys; want none", jobs, holds, keys)
	}
}

// TestAcceptTxOnOneConnection: the first AcceptTx of an Inbox asks
// whether idem is distributed through the caller's transaction, so a pool
// whose only connection that transaction holds accepts (before, the
// question waited for a second connection until the context ran out).
func TestAcceptTxOnOneConnection(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	url, _ := setup(t)
	one := testdb.Pool(t, url, 1)
	in, err := inbox.New(inbox.Config{Pool: one, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) { return nil, record(ctx, tx, d) }})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := one.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	a, err := in.AcceptTx(ctx, tx, &inbox.Delivery{Source: "shop", Key: "one-conn", Payload: []byte(`{}`)})
	if err != nil || a.Duplicate {
		t.Fatalf("AcceptTx on the pool's only connection: %+v %v", a, err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := count(t, one, `SELECT count(*) FROM river_job WHERE kind = $1`, inbox.Kind); n != 1 {
		t.Fatalf("%d jobs after the accept, want 1", n)
	}
}

// TestAtSchema11: an application whose idem schema is still at version 11
// (where idem.distributed() exists but its application role may not ask
// it) runs this inbox as that role: the question whether idem is
// distributed asks Citus' catalog first, and without Citus never asks
// idem.distributed(). Accept, AcceptTx and the worker work.
func TestAtSchema11(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	admin := testdb.Pool(t, url, 4)
	db := stdlib.OpenDBFromPool(admin)
	defer db.Close()
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 11); err != nil {
		t.Fatal(err)
	}
	if _, err := inbox.Migrate(ctx, admin, ""); err != nil {
		t.Fatal(err)
	}
	app := fmt.Sprintf("idem_at11_%d", time.Now().UnixNano())
	for _, q := range []string{`CREATE ROLE ` + app + ` LOGIN`, `SELECT idem.grant_app('` + app + `')`,
		`CREATE TABLE processed (source text, key text, attempt int, at timestamptz DEFAULT clock_timestamp())`,
		`GRANT INSERT, SELECT ON processed TO ` + app} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+app)
		_, _ = admin.Exec(context.Background(), `DROP ROLE `+app)
	})
	if err := inbox.GrantRiver(ctx, admin, ""); err != nil {
		t.Fatal(err)
	}
	var asks bool
	if err := admin.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.distributed()', 'EXECUTE')`, app).Scan(&asks); err != nil || asks {
		t.Fatalf("the app role may ask idem.distributed() at 11 (%v): the test would prove nothing", err)
	}
	pool := testdb.Pool(t, testdb.AsUser(url, app), 8)
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		return nil, record(ctx, tx, d)
	}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "at11-1", Payload: []byte(`{}`)}); err != nil {
		t.Fatalf("Accept as the app role at 11: %v", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := in.AcceptTx(ctx, tx, &inbox.Delivery{Source: "shop", Key: "at11-2", Payload: []byte(`{}`)})
		return err
	}); err != nil {
		t.Fatalf("AcceptTx as the app role at 11: %v", err)
	}
	start(t, in, 2, nil)
	waitFor(t, "both events processed", func() bool {
		return count(t, admin, `SELECT count(*) FROM processed WHERE key LIKE 'at11-%'`) == 2
	})
}
