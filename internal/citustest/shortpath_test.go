package citustest_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/internal/testdb"
)

// TestCitusShortPath (migration 34): a delegated claim is answered by
// idem.claim's short path on its key's shard (idem_shard_<shard>.claim,
// called by idem.citus_claim_local): 100 new keys through Do and 10 of
// them again ran there, none in a copy of idem.claim_general; a policy
// inserted, then changed, is seen by the very next claim (its ttl), and so
// is a hold that appears (the key answers in progress, not acquired); the
// application's role cannot call a copy or idem.citus_claim_local.
func TestCitusShortPath(t *testing.T) {
	pool := setup(t)
	trackFunctions(t, pool)
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	ks := keys("sp", 100)
	for _, k := range ks {
		if r, err := c.Do(ctx, "c", k, func(context.Context) (any, error) { return k, nil }); err != nil || r.Replayed {
			t.Fatalf("Do %s: %+v %v", k, r, err)
		}
	}
	for _, k := range ks[:10] {
		if r, err := c.Do(ctx, "c", k, func(context.Context) (any, error) { return nil, errors.New("ran twice") }); err != nil || !r.Replayed {
			t.Fatalf("Do %s again: %+v %v", k, r, err)
		}
	}
	if got := shardCalls(t, pool, "claim", 110); got != 110 {
		t.Fatalf("%d of 110 claims answered by the short path's copies", got)
	}
	if got := shardCalls(t, pool, "claim_general", 0); got != 0 {
		t.Fatalf("%d claims went to the copies of idem.claim_general", got)
	}

	ttl := func(key string, want time.Duration) {
		t.Helper()
		var got time.Duration
		if err := pool.QueryRow(ctx, `SELECT expires_at - first_seen FROM idem.claim('sp', $1)`, key).Scan(&got); err != nil || got != want {
			t.Fatalf("%s: ttl %v (%v), want %v", key, got, err, want)
		}
	}
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('sp', '2 days', '1 minute', 1)`); err != nil {
		t.Fatal(err)
	}
	ttl("p1", 48*time.Hour)
	if _, err := pool.Exec(ctx, `UPDATE idem.policies SET ttl = '3 days' WHERE source = 'sp'`); err != nil {
		t.Fatal(err)
	}
	ttl("p2", 72*time.Hour)

	if _, err := pool.Exec(ctx, `INSERT INTO idem.holds (source, key, token, held_at) VALUES ('sp', 'held', 1, now())`); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := pool.QueryRow(ctx, `SELECT outcome FROM idem.claim('sp', $1)`, "held").Scan(&outcome); err != nil || outcome != "in_progress" {
		t.Fatalf("a key the inbox holds: %q (%v), want in_progress", outcome, err)
	}

	app := loginRole(t, pool, "idem_citus_app", "grant_app")
	var copy string
	if err := pool.QueryRow(ctx, `SELECT 'idem_shard_' || get_shard_id_for_distribution_column('idem.processed_events', 'x'::text)`).Scan(&copy); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{`SELECT * FROM ` + copy + `.claim('c', 'x')`, `SELECT * FROM idem.citus_claim_local('c', 'x', NULL, NULL, NULL, NULL, NULL)`} {
		if _, err := app.Exec(ctx, q); codeOf(err) != "42501" {
			t.Fatalf("the application's role: %s: %v, want SQLSTATE 42501", q, err)
		}
	}
}

// TestCitusCommitSerialization: a serialization failure that a worker finds
// when Citus commits a claim's transaction comes back from Citus as XX000
// "could not commit transaction for shard ... on at least one active node",
// and idem returns it as idem.ErrSerialization, as it does 40001 (before:
// unmapped, so neither errors.Is nor a retry saw it). Provoked for real on
// the key's worker: a waiting duplicate (WithWait, SERIALIZABLE sessions)
// takes over the key once its lease lapses, in idem's own transaction
// (claimUncounted); before that, a prepared transaction P read the key's
// row, and a transaction F still open read a row P wrote. At the taker's
// commit PostgreSQL finds the dangerous structure F -> P -> taker with P
// prepared, so the taker fails (40001 on the worker, XX000 from Citus).
func TestCitusCommitSerialization(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	url := testdb.Citus(t)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	ser, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ser.Close)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	waiter, err := idem.New(ser, nil)
	if err != nil {
		t.Fatal(err)
	}
	const key = "commit-ser"
	var shard int64
	var port int
	if err := pool.QueryRow(ctx, `SELECT p.shardid, n.nodeport FROM pg_dist_placement p JOIN pg_dist_node n ON n.groupid = p.groupid
		WHERE p.shardid = get_shard_id_for_distribution_column('idem.processed_events', $1::text)`, key).Scan(&shard, &port); err != nil {
		t.Fatal(err)
	}
	wcfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	wcfg.Port = uint16(port)
	worker := func() *pgx.Conn {
		t.Helper()
		conn, err := pgx.ConnectConfig(ctx, wcfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close(context.Background()) })
		return conn
	}
	w := worker()
	for _, q := range []string{
		`SET citus.enable_ddl_propagation = off`,
		`DROP TABLE IF EXISTS public.idem_ssi_x`,
		`CREATE TABLE public.idem_ssi_x (id integer PRIMARY KEY, v integer)`,
		`INSERT INTO public.idem_ssi_x VALUES (1, 0)`,
	} {
		if _, err := w.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = w.Exec(context.Background(), `ROLLBACK PREPARED 'idem_ssi_test'`)
		_, _ = w.Exec(context.Background(), `DROP TABLE IF EXISTS public.idem_ssi_x`)
	})

	// The key in progress under a short lease, never finished.
	if cl, err := c.Claim(ctx, "c", key, idem.WithLease(4*time.Second)); err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("the first claim: %+v %v", cl, err)
	}
	type answer struct {
		cl  *idem.Claim
		err error
	}
	done := make(chan answer, 1)
	go func() {
		cl, err := waiter.Claim(ctx, "c", key, idem.WithWait(30*time.Second))
		done <- answer{cl, err}
	}()

	// F reads what P writes; P reads the key's row and is prepared: both
	// before the lease lapses and the waiter takes the key over.
	f := worker()
	tf, err := f.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.Serializable})
	if err != nil {
		t.Fatal(err)
	}
	defer tf.Rollback(context.Background())
	var v int
	if err := tf.QueryRow(ctx, `SELECT v FROM public.idem_ssi_x WHERE id = 1`).Scan(&v); err != nil {
		t.Fatal(err)
	}
	p := worker()
	for _, q := range []string{
		`BEGIN ISOLATION LEVEL SERIALIZABLE`,
		`UPDATE public.idem_ssi_x SET v = v + 1 WHERE id = 1`,
		fmt.Sprintf(`SELECT status FROM idem.processed_events_%d WHERE source = 'c' AND key = '%s'`, shard, key),
		`PREPARE TRANSACTION 'idem_ssi_test'`,
	} {
		if _, err := p.Exec(ctx, q); err != nil {
			t.Fatalf("P: %s: %v", q, err)
		}
	}
	var a answer
	select {
	case a = <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("the waiter did not return")
	}
	t.Logf("the waiter's take-over: %v (SQLSTATE %s)", a.err, codeOf(a.err))
	if codeOf(a.err) != sqlstate.InternalError || !sqlstate.CitusCommitFailed(a.err) {
		t.Fatalf("the take-over's commit: %+v %v (SQLSTATE %s), want Citus' XX000 at commit", a.cl, a.err, codeOf(a.err))
	}
	if !errors.Is(a.err, idem.ErrSerialization) {
		t.Fatalf("Citus' failure at commit: %v, want idem.ErrSerialization", a.err)
	}
	// Rolled back: once P and F are gone, the take-over succeeds.
	if _, err := p.Exec(ctx, `ROLLBACK PREPARED 'idem_ssi_test'`); err != nil {
		t.Fatal(err)
	}
	if err := tf.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if cl, err := waiter.Claim(ctx, "c", key); err != nil || cl.Outcome != idem.Acquired || cl.Attempt != 2 {
		t.Fatalf("the take-over again: %+v %v, want acquired, attempt 2", cl, err)
	}
}
