package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestCachedPlanIsNoIsolationError: PostgreSQL's "cached plan must not
// change result type" (SQLSTATE 0A000, after a schema change under pgx's
// statement cache) is not idem.ErrIsolationNotSupported, and is retried (pgx
// dropped the statement; sent again it succeeds), while idem.claim's
// refusal of REPEATABLE READ (also 0A000) still is that error, and final.
// Before, every 0A000 was an isolation error, never retried.
func TestCachedPlanIsNoIsolationError(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `CREATE TABLE t (a int, b int); INSERT INTO t VALUES (1, 2)`); err != nil {
		t.Fatal(err)
	}
	var a, b int
	if err := conn.QueryRow(ctx, `SELECT * FROM t WHERE a = $1`, 1).Scan(&a, &b); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `ALTER TABLE t DROP COLUMN b`); err != nil {
		t.Fatal(err)
	}
	err = conn.QueryRow(ctx, `SELECT * FROM t WHERE a = $1`, 1).Scan(&a)
	cerr := idem.ConvertForTest("claim", "s", "k", err)
	if err == nil || errors.Is(cerr, idem.ErrIsolationNotSupported) || !idem.TransientForTest(cerr) {
		t.Fatalf("cached plan: %v; isolation %v, transient %v", cerr, errors.Is(cerr, idem.ErrIsolationNotSupported), idem.TransientForTest(cerr))
	}
	if err := conn.QueryRow(ctx, `SELECT * FROM t WHERE a = $1`, 1).Scan(&a); err != nil {
		t.Fatalf("sent again: %v", err)
	}

	tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	_, err = testdb.Client(t, tx, nil).Claim(ctx, "s", "k")
	if !errors.Is(err, idem.ErrIsolationNotSupported) || idem.TransientForTest(err) {
		t.Fatalf("REPEATABLE READ: %v", err)
	}
}

// TestCitusCommitFailedConverted: Citus' report of a worker's part that
// failed at commit (XX000 "could not commit transaction for shard ... on at
// least one active node", as Citus 13 words it; a serialization failure
// at the worker's commit comes back so) is ErrSerialization and retried
// like 40001; another XX000 is neither. (The real one, provoked on a
// cluster: citustest.TestCitusCommitSerialization.)
func TestCitusCommitFailedConverted(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		msg  string
		want bool
	}{
		{"could not commit transaction for shard 102008 on at least one active node", true},
		{"could not commit transaction for shard 7 on at least one active node", true},
		{"cache lookup failed for function 12345", false},
		{"could not commit transaction on the coordinator", false},
	} {
		t.Run(c.msg, func(t *testing.T) {
			t.Parallel()
			err := idem.ConvertForTest("claim_batch", "s", "k", &pgconn.PgError{Code: "XX000", Message: c.msg})
			if got := errors.Is(err, idem.ErrSerialization); got != c.want {
				t.Errorf("ErrSerialization: %v, want %v (%v)", got, c.want, err)
			}
			if got := idem.TransientForTest(err); got != c.want {
				t.Errorf("transient: %v, want %v", got, c.want)
			}
		})
	}
}
