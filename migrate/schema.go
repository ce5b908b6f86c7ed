package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
)

// ErrUnsafeSchema: schema idem exists and is owned by, or lets create
// objects in it, a role other than the one migrating. Such a role could
// drop idem's tables, or plant a table under a future month's partition
// name; migrating into it would hand idem's objects to it.
var ErrUnsafeSchema = errors.New("idem/migrate: schema idem is owned by, or writable by, another role")

// UnsafeSchemaError says who owns or may write schema idem, and the
// statements that make it safe.
type UnsafeSchemaError struct {
	Migrator string   // the role migrating (current_user), quoted as SQL needs
	Owner    string   // the schema's owner, quoted likewise
	Writers  []string // roles other than the owner with CREATE on it ("PUBLIC" for everyone)
	// Installed: idem's objects are in the schema (its version table is):
	// the migrator must be the role that owns them, not a new owner.
	Installed bool
}

func (e *UnsafeSchemaError) Error() string {
	var what, fix []string
	// idem's routines run as the role that made them: once installed, the
	// schema must not move to another owner (that would take their rights
	// away); the migrator must be that role.
	installedByOther := e.Owner != e.Migrator && e.Installed
	switch {
	case installedByOther:
		what = append(what, fmt.Sprintf("idem is installed by %s, not by %s who migrates", e.Owner, e.Migrator))
	case e.Owner != e.Migrator:
		what = append(what, fmt.Sprintf("it is owned by %s, not by %s who migrates", e.Owner, e.Migrator))
		fix = append(fix, fmt.Sprintf("ALTER SCHEMA idem OWNER TO %s;", e.Migrator))
	}
	if len(e.Writers) > 0 {
		what = append(what, fmt.Sprintf("%s may create objects in it", strings.Join(e.Writers, ", ")))
		for _, w := range e.Writers {
			fix = append(fix, fmt.Sprintf("REVOKE CREATE ON SCHEMA idem FROM %s;", w))
		}
	}
	msg := fmt.Sprintf("%v: %s.", ErrUnsafeSchema, strings.Join(what, "; "))
	if len(fix) > 0 {
		msg += fmt.Sprintf(" Run, as its owner or a superuser: %s (then inspect what is in schema idem)", strings.Join(fix, " "))
	}
	if installedByOther {
		return msg + fmt.Sprintf(" Migrate as %s: connect as that role, or (as a member of it) SET ROLE %s first", e.Owner, e.Owner)
	}
	return msg + ", and migrate again"
}

func (e *UnsafeSchemaError) Is(target error) bool { return target == ErrUnsafeSchema }

type queryRower interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// CheckSchema returns an *UnsafeSchemaError when schema idem exists and
// someone other than the migrating role owns it or may create in it.
func CheckSchema(ctx context.Context, db queryRower) error {
	var e UnsafeSchemaError
	var writers string
	var mine bool
	err := db.QueryRowContext(ctx, `
		SELECT n.nspowner::pg_catalog.regrole::text,
		       (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = current_user)::pg_catalog.regrole::text,
		       n.nspowner = (SELECT r.oid FROM pg_catalog.pg_roles r WHERE r.rolname = current_user),
		       pg_catalog.to_regclass('idem.goose_db_version') IS NOT NULL,
		       coalesce(pg_catalog.string_agg(
		           coalesce(NULLIF(a.grantee, 0::oid)::pg_catalog.regrole::text, 'PUBLIC'), ',' ORDER BY a.grantee)
		           FILTER (WHERE a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner), '')
		  FROM pg_catalog.pg_namespace n
		  LEFT JOIN LATERAL pg_catalog.aclexplode(n.nspacl) a ON true
		 WHERE n.nspname = $1
		 GROUP BY n.nspowner`, Schema).Scan(&e.Owner, &e.Migrator, &mine, &e.Installed, &writers)
	switch {
	case errors.Is(err, sql.ErrNoRows):
		return nil
	case err != nil:
		return fmt.Errorf("idem/migrate: look at schema %s: %w", Schema, err)
	}
	if writers != "" {
		e.Writers = strings.Split(writers, ",")
	}
	if !mine || len(e.Writers) > 0 {
		return &e
	}
	return nil
}
