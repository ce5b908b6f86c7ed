package inbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/migrate"
)

// MigrateLockID is the transaction advisory lock that serializes River
// migrations run by idem: the bytes "idem" + 3 (see migrate.LockID).
const MigrateLockID = migrate.LockID + 2

// ErrRiverSchemaNotWritable: the role may not create River's tables in the
// schema they go in (on PostgreSQL 15 and later only the database's owner
// may create in schema public). The error says what to do.
var ErrRiverSchemaNotWritable = errors.New("inbox: the role may not create River's tables in their schema")

// Migrate applies River's own migrations (River's migration API, River's
// tables, in schema, "" for the search_path) up to the version this build
// of River knows, and returns the versions it applied. Only the versions
// missing are applied, each in a transaction of its own (some of River's
// cannot share one) that first takes the transaction advisory lock
// MigrateLockID and then looks at which versions are applied: two
// migrators never apply the same version, and the lock holds through a
// transaction pooler (PgBouncer in transaction mode), where a session lock
// would be taken and released on different server sessions. It is safe
// next to an application that already runs River in the same database:
// versions the application applied are left alone, and a database already
// past this build's version is not touched. A migrator outside idem that
// applied the same version at the same moment makes it look again. Then
// idem's application and maintainer roles get their rights on River's
// tables (GrantRiver).
func Migrate(ctx context.Context, pool *pgxpool.Pool, schema string) ([]int, error) {
	m, err := rivermigrate.New(riverpgxv5.New(pool), &rivermigrate.Config{Schema: schema, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, fmt.Errorf("inbox: River migrator: %w", err)
	}
	var applied []int
	for conflicts := 0; ; {
		// Nothing missing: no lock to wait for (any session may hold it).
		if done, err := upToDate(ctx, m); err == nil && done {
			break
		}
		v, err := migrateStep(ctx, pool, m)
		if c := sqlstate.Of(err); (c == sqlstate.UniqueViolation || c == sqlstate.DuplicateTable) && conflicts < 3 {
			conflicts++
			continue // a migrator outside idem got there first: look again
		}
		if err != nil {
			return applied, riverError(ctx, pool, schema, err)
		}
		if v == 0 {
			break
		}
		applied = append(applied, v)
	}
	// idem's roles get their rights on River's tables, new or not.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return GrantRiver(ctx, tx, schema) }); err != nil {
		return applied, err
	}
	return applied, nil
}

// upToDate reports whether every River version this build knows is
// applied (an error, such as no River table yet, is "no").
func upToDate(ctx context.Context, m *rivermigrate.Migrator[pgx.Tx]) (bool, error) {
	existing, err := m.ExistingVersions(ctx)
	if err != nil {
		return false, err
	}
	have := map[int]bool{}
	for _, v := range existing {
		have[v.Version] = true
	}
	for _, v := range m.AllVersions() {
		if !have[v.Version] {
			return false, nil
		}
	}
	return true, nil
}

// migrateStep applies the next missing River version, if any, in a
// transaction that holds MigrateLockID, and returns it (0: none missing).
// River's MigrateTx is the one way to run a River migration in a
// transaction of the caller's, which the lock needs; one step at a time, as
// River's Migrate does.
func migrateStep(ctx context.Context, pool *pgxpool.Pool, m *rivermigrate.Migrator[pgx.Tx]) (int, error) {
	var v int
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, migrate.LockStatement(MigrateLockID)); err != nil {
			return fmt.Errorf("lock: %w", err)
		}
		res, err := m.MigrateTx(ctx, tx, rivermigrate.DirectionUp, &rivermigrate.MigrateOpts{MaxSteps: 1}) //nolint:staticcheck // see above
		if err != nil {
			return err
		}
		if len(res.Versions) > 0 {
			v = res.Versions[0].Version
		}
		return nil
	})
	return v, err
}

// riverError says what to do when the role may not create River's tables.
func riverError(ctx context.Context, pool *pgxpool.Pool, schema string, err error) error {
	if sqlstate.Of(err) != sqlstate.InsufficientPrivilege {
		return fmt.Errorf("inbox: River migrations: %w", err)
	}
	where, what := schema, "the schema asked for"
	if schema == "" {
		what = "the search_path's first schema"
	}
	var role, roleIdent, whereIdent string
	_ = pool.QueryRow(ctx, `SELECT current_user, pg_catalog.quote_ident(current_user),
	                               coalesce(nullif($1, ''), current_schema(), ''), pg_catalog.quote_ident(coalesce(nullif($1, ''), current_schema(), ''))`,
		schema).Scan(&role, &roleIdent, &where, &whereIdent)
	return fmt.Errorf("%w: River's tables go in schema %q (%s), where role %q may not CREATE (on PostgreSQL 15 and later only the database's owner may create in schema public). "+
		"Either give River a schema the role owns (CREATE SCHEMA river AUTHORIZATION %s; then idemctl migrate up --river-schema river, "+
		"or inbox.Migrate's schema argument, and the same schema in the inbox's Config), or GRANT CREATE ON SCHEMA %s TO %s, "+
		"or skip River's step (idemctl migrate up --river=false) if the inbox is not used: %w",
		ErrRiverSchemaNotWritable, where, what, role, roleIdent, whereIdent, roleIdent, err)
}

// errNotMigrated is returned when River's tables are missing.
var errNotMigrated = errors.New("inbox: River's tables are missing; run idemctl migrate up (or inbox.Migrate)")
