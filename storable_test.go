package idem_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// unstorableResults are results the server refuses: each completes the key
// without its result.
var unstorableResults = map[string]any{
	"over 1 MiB":           map[string]string{"blob": strings.Repeat("x", 1100000)},
	"over 1 MiB as jsonb":  json.RawMessage("[" + strings.Repeat("0,", 300000) + "0]"),
	"NUL":                  map[string]string{"s": "a\x00b"},
	"lone high surrogate":  json.RawMessage(`{"s": "\ud800"}`),
	"lone low surrogate":   json.RawMessage(`"\udc00x"`),
	"number over numeric":  json.RawMessage(`1e131072`),
	"number under numeric": json.RawMessage(`[1e-16384]`),
	"invalid UTF-8":        json.RawMessage("\"\xff\""),
	"not JSON":             json.RawMessage(`{"a":`),
}

// TestUnstorableResultInCallersTx: in the caller's transaction (pgx's
// WithTx and database/sql's WithSQLTx) a result the server would refuse
// completes the key without it, as on a pool: Do returns an error matching
// ErrResultNotStored, the caller's transaction survives and commits its
// writes and the completion, and no later delivery runs the work again.
// Before, the refused statement aborted the caller's transaction: nothing
// committed, and every delivery ran the work again.
func TestUnstorableResultInCallersTx(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (id text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	c, sc := testdb.Client(t, pool, nil), testdb.SQLClient(t, db, nil)
	// deliver runs one delivery of key in a transaction of the driver's
	// and commits it; it returns Do's error and whether the work ran.
	deliver := map[string]func(t *testing.T, key string, result any) (bool, error){
		"pgx": func(t *testing.T, key string, result any) (ran bool, doErr error) {
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				_, doErr = c.WithTx(tx).Do(ctx, "tx", key, func(ctx context.Context) (any, error) {
					ran = true
					_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ($1)`, key)
					return result, err
				})
				return nil
			})
			if err != nil {
				t.Fatalf("commit: %v (Do: %v)", err, doErr)
			}
			return ran, doErr
		},
		"database/sql": func(t *testing.T, key string, result any) (ran bool, doErr error) {
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, doErr = sc.WithSQLTx(tx).Do(ctx, "tx", key, func(ctx context.Context) (any, error) {
				ran = true
				_, err := tx.ExecContext(ctx, `INSERT INTO ledger VALUES ($1)`, key)
				return result, err
			})
			if err := tx.Commit(); err != nil {
				t.Fatalf("commit: %v (Do: %v)", err, doErr)
			}
			return ran, doErr
		},
	}
	for driver, deliver := range deliver {
		for name, result := range unstorableResults {
			t.Run(driver+"/"+name, func(t *testing.T) {
				key := driver + "/" + name
				ran, err := deliver(t, key, result)
				if !ran || !errors.Is(err, idem.ErrResultNotStored) {
					t.Fatalf("first delivery: ran %v, %v; want ErrResultNotStored", ran, err)
				}
				for range 2 {
					ran, err := deliver(t, key, result)
					if ran || err != nil {
						t.Fatalf("redelivery: ran %v, %v", ran, err)
					}
				}
				var n int
				if err := pool.QueryRow(ctx, `SELECT count(*)::int FROM ledger WHERE id = $1`, key).Scan(&n); err != nil || n != 1 {
					t.Fatalf("ledger rows %d %v, want the work's write committed once", n, err)
				}
				cl, err := c.Claim(ctx, "tx", key)
				if err != nil || cl.Outcome != idem.Completed || cl.Result != nil || !strings.HasPrefix(cl.Error, "result not stored: ") {
					t.Fatalf("after: %+v %v", cl, err)
				}
			})
		}
	}
}

// TestCheckResult: CheckResult refuses exactly what jsonb refuses, as the
// server answers for each (the fuzz test FuzzStorable compares the two on
// any input).
func TestCheckResult(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := setup(t)
	for _, s := range []string{`null`, `{"a": [1, 2.5, -0.0]}`, `"\ud83d\ude00"`, `"\u00e9"`, `1e131071`, `1e-16383`,
		`0e100000000`, `0e-16383`, `0e-16384`, `1e131072`, `[1e-16384]`, `"\u0000"`, `"\ud800"`, `"\udc00"`, `"\ud800\u0041"`,
		`"\ud800\ud800"`, `12345678901234567890123456789`, `0.` + strings.Repeat("0", 16383) + `1`, "[" + strings.Repeat("1", 131073) + "]",
		`1E+5`, `-1e-2`, `1e2147483647`, `1e-1073741822`, `0e1073741823`} {
		goErr := idem.CheckResult([]byte(s))
		var out string
		pgErr := pool.QueryRow(ctx, `SELECT $1::text::jsonb::text`, s).Scan(&out)
		if (goErr == nil) != (pgErr == nil) {
			t.Errorf("%.60s: CheckResult %v, PostgreSQL %v", s, goErr, pgErr)
		}
		if goErr != nil && !errors.Is(goErr, idem.ErrInvalidInput) {
			t.Errorf("%.60s: %v is not ErrInvalidInput", s, goErr)
		}
	}
}
