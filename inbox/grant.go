package inbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Execer runs statements and queries: a pool, a connection or a
// transaction.
type Execer interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
	Query(context.Context, string, ...any) (pgx.Rows, error)
	QueryRow(context.Context, string, ...any) pgx.Row
}

// The rights on River's tables (those that exist) that idem's two roles
// need once the inbox is used:
//   - the application role (idem.grant_app): the web process inserts jobs,
//     the worker runs River (fetching, completing, leadership, queues,
//     maintenance: the reindexer excepted, which NewWorkerClient turns off
//     since it needs to own the tables);
//   - the maintainer role (idem.grant_maintainer): stats, check and
//     inbox list read the jobs; replay inserts a job and deletes the dead
//     one (River inserts with INSERT ... ON CONFLICT DO UPDATE).
var riverGrants = []struct{ role, table, rights string }{
	{"app", "river_job", "SELECT, INSERT, UPDATE, DELETE"},
	{"app", "river_leader", "SELECT, INSERT, UPDATE, DELETE"},
	{"app", "river_queue", "SELECT, INSERT, UPDATE, DELETE"},
	{"app", "river_client", "SELECT, INSERT, UPDATE, DELETE"},
	{"app", "river_client_queue", "SELECT, INSERT, UPDATE, DELETE"},
	{"app", "river_migration", "SELECT"},
	{"app", "river_job_id_seq", "USAGE, SELECT"},
	{"maintainer", "river_job", "SELECT, INSERT, UPDATE, DELETE"}, // River inserts with ON CONFLICT DO UPDATE
	{"maintainer", "river_queue", "SELECT"},
	{"maintainer", "river_migration", "SELECT"},
	{"maintainer", "river_job_id_seq", "USAGE, SELECT"},
}

// GrantRiver gives idem's application and maintainer roles (every role
// idem.grant_app or idem.grant_maintainer was run for) the rights they
// need on River's tables in schema ("" for the search_path's), when those
// tables exist. Migrate runs it after River's migrations and idemctl grant
// after granting idem's rights, so the roles stay right whichever comes
// first. Run it as the owner of River's tables.
func GrantRiver(ctx context.Context, db Execer, schema string) error {
	roles := map[string][]string{}
	for role, fn := range map[string]string{"app": "idem.queue_take(text, text, bigint, bigint, interval)", "maintainer": "idem.prunable_rows()"} {
		rows, err := db.Query(ctx, `
			SELECT a.grantee::regrole::text
			  FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
			 WHERE p.oid = pg_catalog.to_regprocedure($1)::oid AND a.privilege_type = 'EXECUTE'
			   AND a.grantee <> 0::oid AND a.grantee <> p.proowner`, fn)
		if err != nil {
			return fmt.Errorf("inbox: find idem's roles: %w", err)
		}
		if roles[role], err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return fmt.Errorf("inbox: find idem's roles: %w", err)
		}
	}
	if len(roles["app"])+len(roles["maintainer"]) == 0 {
		return nil
	}
	if schema != "" {
		for _, r := range append(roles["app"], roles["maintainer"]...) {
			if _, err := db.Exec(ctx, fmt.Sprintf("GRANT USAGE ON SCHEMA %s TO %s", pgx.Identifier{schema}.Sanitize(), r)); err != nil {
				return fmt.Errorf("inbox: grant River's schema to %s: %w", r, err)
			}
		}
	}
	for _, g := range riverGrants {
		name := riverTable(schema, g.table)
		var exists bool
		if err := db.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, name).Scan(&exists); err != nil {
			return fmt.Errorf("inbox: look for %s: %w", name, err)
		}
		if !exists {
			continue
		}
		kind := "TABLE"
		if g.table == "river_job_id_seq" {
			kind = "SEQUENCE"
		}
		for _, r := range roles[g.role] {
			// r is a regrole's text output: a quoted identifier.
			if _, err := db.Exec(ctx, fmt.Sprintf("GRANT %s ON %s %s TO %s", g.rights, kind, name, r)); err != nil {
				return fmt.Errorf("inbox: grant %s on %s to %s: %w", g.rights, name, r, err)
			}
		}
	}
	return nil
}
