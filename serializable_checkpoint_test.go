package idem_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestSerializableCheckpointUnreadable: idem installed by an owner that is
// not a superuser, on a database where pg_control_checkpoint() is revoked
// from PUBLIC (as hardened and hosted setups do). idem.serializable_floor
// cannot read the last checkpoint, so a SERIALIZABLE claim's placeholders
// go into every month of the window: SERIALIZABLE claims and batches of
// new keys and duplicates answer as in READ COMMITTED, and the race of
// TestSerializableClaimsAcrossMonths (clocks either side of a month's end)
// still acquires every key once. Before migration 33, every SERIALIZABLE
// claim of a new key and every SERIALIZABLE batch failed with 42501.
func TestSerializableCheckpointUnreadable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	admin, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	owner := fmt.Sprintf("ckpt_owner_%d", time.Now().UnixNano()%1e9)
	exec := func(db *sql.DB, q string) {
		t.Helper()
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	exec(admin, `CREATE ROLE `+owner+` LOGIN`)
	t.Cleanup(func() {
		_, _ = admin.ExecContext(context.Background(), `DROP OWNED BY `+owner)
		_, _ = admin.ExecContext(context.Background(), `DROP ROLE `+owner)
	})
	exec(admin, `DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO `+owner+`', current_database()); END $$`)
	ownerURL := testdb.AsUser(url, owner)
	ownerDB, err := sql.Open("pgx", ownerURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ownerDB.Close() })
	if _, err := migrate.Up(ctx, ownerDB); err != nil {
		t.Fatalf("migrate up as %s: %v", owner, err)
	}
	exec(admin, pgcluster.ClockOverrideSQL) // for the race's clocks
	// pg_catalog's ACLs are the database's own: this database only.
	exec(admin, `REVOKE EXECUTE ON FUNCTION pg_catalog.pg_control_checkpoint() FROM PUBLIC`)

	pool := testdb.Pool(t, ownerURL, 4)
	if err := pool.QueryRow(ctx, `SELECT 1 FROM pg_catalog.pg_control_checkpoint()`).Scan(new(int)); err == nil {
		t.Fatal("the owner can still read the checkpoint: the test proves nothing")
	}
	var floor time.Time
	if err := pool.QueryRow(ctx, `SELECT idem.serializable_floor(now(), '2020-01-01')`).Scan(&floor); err != nil ||
		!floor.Equal(time.Date(2020, 1, 1, 0, 0, 0, 0, time.UTC)) {
		t.Errorf("serializable_floor without the checkpoint: %v %v, want the window's first month", floor, err)
	}
	c := testdb.Client(t, pool, nil)
	serializable := func(t *testing.T, f func(c *idem.Client) error) {
		t.Helper()
		if err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
			return f(c.WithTx(tx))
		}); err != nil {
			t.Fatal(err)
		}
	}
	t.Run("claim", func(t *testing.T) {
		for _, want := range []idem.Outcome{idem.Acquired, idem.InProgress} {
			serializable(t, func(c *idem.Client) error {
				cl, err := c.Claim(ctx, "s", "k1", idem.WithTTL(400*24*time.Hour))
				if err == nil && cl.Outcome != want {
					err = fmt.Errorf("SERIALIZABLE claim: %s, want %s", cl.Outcome, want)
				}
				return err
			})
		}
	})
	t.Run("batch", func(t *testing.T) {
		serializable(t, func(c *idem.Client) error {
			cls, err := c.ClaimBatch(ctx, "s", []idem.BatchItem{{Key: "k1"}, {Key: "b1"}, {Key: "b2"}})
			if err == nil && (cls[0].Outcome != idem.InProgress || cls[1].Outcome != idem.Acquired || cls[2].Outcome != idem.Acquired) {
				err = fmt.Errorf("SERIALIZABLE batch: %s %s %s, want in_progress acquired acquired", cls[0].Outcome, cls[1].Outcome, cls[2].Outcome)
			}
			return err
		})
	})
	t.Run("race", func(t *testing.T) {
		acquired, rows := raceAcrossMonths(t, ownerURL)
		acquired.requireOnceEach(t, rows)
	})
}
