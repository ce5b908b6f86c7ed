package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/migrate"
)

// MigrateLockID is the transaction advisory lock that serializes River
// migrations run by idem: the bytes "idem" + 3 (see migrate.LockID).
const MigrateLockID = migrate.LockID + 2

// Migrate applies River's own migrations (River's migration API, River's
// tables, in schema, "" for the search_path) up to the version this build
// of River knows, and returns the versions it applied. Only the versions
// missing are applied, each in its own transaction (some of River's cannot
// share one), under the session advisory lock MigrateLockID, so it is safe
// next to an application that already runs River in the same database:
// versions the application applied are left alone, and a database already
// past this build's version is not touched. A migrator outside idem that
// applied the same versions at the same moment makes it look again once.
// Then idem's application and maintainer roles get their rights on
// River's tables (GrantRiver).
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) ([]int, error) {
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, fmt.Errorf("inbox: River migrator: %w", err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("inbox: River migrations: %w", err)
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, MigrateLockID); err != nil {
		return nil, fmt.Errorf("inbox: River migrations: lock: %w", err)
	}
	defer conn.Exec(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1)`, MigrateLockID)
	for attempt := 1; ; attempt++ {
		res, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil)
		if err == nil {
			applied := make([]int, 0, len(res.Versions))
			for _, v := range res.Versions {
				applied = append(applied, v.Version)
			}
			// idem's roles get their rights on River's tables, new or not.
			if err := GrantRiver(ctx, conn, schema); err != nil {
				return applied, err
			}
			return applied, nil
		}
		if attempt == 1 && (sqlstate.Of(err) == sqlstate.UniqueViolation || sqlstate.Of(err) == sqlstate.DuplicateTable) {
			continue // another migrator got there first: look again
		}
		return nil, fmt.Errorf("inbox: River migrations: %w", err)
	}
}

// errNotMigrated is returned when River's tables are missing.
var errNotMigrated = errors.New("inbox: River's tables are missing; run idemctl migrate up (or inbox.Migrate)")
