package migrate

import (
	"context"
	"database/sql"
	"fmt"

	"github.com/idemkit/idem/db/sqldb"
)

// Citus makes the idem of this database a distributed one: run on a Citus
// coordinator (with its workers added) after Up. It calls
// idem.citus_setup() (sql/schema/functions/citus_setup.sql), which distributes processed_events
// and holds by key, makes the small shared tables reference tables and
// delegates every per-key function to the node that holds its key, and
// returns what it did (nothing when it had already been done). Re-run it
// after every Up on a distributed installation (idemctl migrate up does):
// a migration that replaces a per-key function resets the settings Citus
// needs. docs/citus.md says what changes and what does not work there.
func Citus(ctx context.Context, db *sql.DB) ([]string, error) {
	rows, err := db.QueryContext(ctx, `SELECT s FROM idem.citus_setup() s`)
	if err != nil {
		return nil, fmt.Errorf("idem/migrate: citus: %w", err)
	}
	defer rows.Close()
	var done []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return nil, fmt.Errorf("idem/migrate: citus: %w", err)
		}
		done = append(done, s)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("idem/migrate: citus: %w", err)
	}
	return done, nil
}

// Distributed reports whether idem.processed_events is a Citus distributed
// table (false when Citus is not installed, or idem is older than
// migration 11). It asks Citus' catalog first, then idem.distributed()
// only where Citus is installed, as the inbox does (the same two queries).
func Distributed(ctx context.Context, db *sql.DB) (bool, error) {
	q := sqldb.New(db)
	d, err := q.CitusInstalled(ctx)
	if err == nil && d {
		d, err = q.Distributed(ctx)
	}
	if err != nil {
		return false, fmt.Errorf("idem/migrate: %w", err)
	}
	return d, nil
}
