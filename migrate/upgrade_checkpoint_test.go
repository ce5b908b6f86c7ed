package migrate_test

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// checkpointUnreadableVersion is the migration whose
// idem.serializable_floor falls back to the whole window when the last
// checkpoint cannot be read.
const checkpointUnreadableVersion = 33

// TestUpgradeToCheckpointUnreadable: idem owned by a role that is not a
// superuser, pg_control_checkpoint() revoked from PUBLIC, at version 32
// holding data: a SERIALIZABLE claim of a new key fails (42501). The
// upgrade keeps every answer, and SERIALIZABLE claims of new keys and
// their duplicates answer again; down restores the failure and keeps every
// answer; up again. The behaviour:
// idem_test.TestSerializableCheckpointUnreadable.
func TestUpgradeToCheckpointUnreadable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	admin, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	owner := fmt.Sprintf("ckpt_up_owner_%d", time.Now().UnixNano()%1e9)
	for _, q := range []string{
		`CREATE ROLE ` + owner + ` LOGIN`,
		`DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO ` + owner + `', current_database()); END $$`,
		`REVOKE EXECUTE ON FUNCTION pg_catalog.pg_control_checkpoint() FROM PUBLIC`,
	} {
		if _, err := admin.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.ExecContext(context.Background(), `DROP OWNED BY `+owner)
		_, _ = admin.ExecContext(context.Background(), `DROP ROLE `+owner)
	})
	db, err := sql.Open("pgx", testdb.AsUser(url, owner))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, serializableCostVersion); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	// serializable claims key twice in SERIALIZABLE transactions and
	// reports the first error.
	serializable := func(key string) error {
		for _, want := range []string{"acquired", "in_progress"} {
			tx, err := db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelSerializable})
			if err != nil {
				return err
			}
			var outcome string
			err = tx.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', $1, ttl => '400 days')`, key).Scan(&outcome)
			if err == nil && outcome != want {
				err = fmt.Errorf("SERIALIZABLE claim of %s: %s, want %s", key, outcome, want)
			}
			if err != nil {
				_ = tx.Rollback()
				return err
			}
			if err := tx.Commit(); err != nil {
				return err
			}
		}
		return nil
	}
	if err := serializable("ser-before"); err == nil {
		t.Fatal("at version 32 a SERIALIZABLE claim worked without the checkpoint: the test proves nothing")
	}
	if _, err := p.UpTo(ctx, checkpointUnreadableVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade")
	if err := serializable("ser-after"); err != nil {
		t.Fatalf("after the upgrade: %v", err)
	}
	if _, err := p.DownTo(ctx, checkpointUnreadableVersion-1); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down")
	if err := serializable("ser-down"); err == nil {
		t.Fatal("down: a SERIALIZABLE claim worked without the checkpoint: migration 32's function was not restored")
	}
	if _, err := p.UpTo(ctx, checkpointUnreadableVersion); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
	if err := serializable("ser-again"); err != nil {
		t.Fatalf("up again: %v", err)
	}
}

// TestUpgradeFrom32EveryState (claimshort_test.go) takes the every-state
// fixture at version 32 through this migration to the latest.
