// Package dbutil holds the small database helpers idemctl's packages share.
package dbutil

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// SetLocalTimeouts sets lock_timeout and statement_timeout for the rest of
// tx only (SET LOCAL semantics), which holds through PgBouncer's
// transaction pooling where session settings would leak or vanish.
func SetLocalTimeouts(ctx context.Context, tx pgx.Tx, lock, statement time.Duration) error {
	_, err := tx.Exec(ctx, `SELECT set_config('lock_timeout', $1, true), set_config('statement_timeout', $2, true)`,
		fmt.Sprint(lock.Milliseconds()), fmt.Sprint(statement.Milliseconds()))
	return err
}
