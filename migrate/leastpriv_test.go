package migrate_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestMigratorNameNeedingQuotes: a migrating role whose name needs quoting
// (a dash or a capital, as in "idem-owner") owns the schema idem it made.
// CheckSchema compares the owner printed as regrole (quoted: "Idem-Owner")
// with current_user printed as text (unquoted), so every later migrate up
// is refused as if the schema were somebody else's.
func TestMigratorNameNeedingQuotes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	admin, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close() })
	role := fmt.Sprintf("Idem-Owner-%d", time.Now().UnixNano()%1e9)
	id := pgx.Identifier{role}.Sanitize()
	for _, q := range []string{
		`CREATE ROLE ` + id + ` LOGIN`,
		`DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO ` + `%I', current_database(), '` + role + `'); END $$`,
	} {
		if _, err := admin.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = admin.ExecContext(context.Background(), `DROP OWNED BY `+id)
		_, _ = admin.ExecContext(context.Background(), `DROP ROLE `+id)
	})
	db, err := sql.Open("pgx", testdb.AsUser(url, role))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatalf("first migrate up as %s: %v", role, err)
	}
	if err := migrate.CheckSchema(ctx, db); err != nil {
		t.Fatalf("CheckSchema on the schema %s made itself: %v", role, err)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatalf("second migrate up as %s (a no-op): %v", role, err)
	}
}

// TestCallableFunctionsPinSearchPath: every function of schema idem that a
// role other than its owner may execute pins search_path = pg_catalog,
// pg_temp, so it resolves no operator or function through a schema another
// role can write. The helpers only idem's functions call (days_at_most,
// activity_minute, check_key, ...) run under their caller's pinned path;
// pinning them too would keep the SQL ones from being inlined on the claim
// path.
func TestCallableFunctionsPinSearchPath(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `CREATE ROLE pin_app; CREATE ROLE pin_maint; SELECT idem.grant_app('pin_app'), idem.grant_maintainer('pin_maint')`); err != nil {
		t.Fatal(err)
	}
	defer db.ExecContext(context.Background(), `DROP OWNED BY pin_app; DROP OWNED BY pin_maint; DROP ROLE pin_app; DROP ROLE pin_maint`)
	unpinned := queryStrings(t, ctx, db, `
		SELECT DISTINCT p.oid::regprocedure::text FROM pg_proc p, aclexplode(p.proacl) a
		 WHERE p.pronamespace = 'idem'::regnamespace AND p.prokind = 'f'
		   AND a.privilege_type = 'EXECUTE' AND a.grantee <> p.proowner
		   AND NOT EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c = 'search_path=pg_catalog, pg_temp')
		 ORDER BY 1`)
	// SQL one-liners inlined into the claim's statements (a SET clause
	// would keep them from being inlined), written with qualified
	// functions and operators whose argument types match pg_catalog's
	// exactly: AT TIME ZONE is pg_catalog.timezone whatever the path.
	immune := map[string]bool{"idem.clock()": true, "idem.utc_month(timestamp with time zone)": true, "idem.partition_name(date)": true}
	var bad []string
	for _, f := range unpinned {
		if !immune[f] {
			bad = append(bad, f)
		}
	}
	if len(bad) > 0 {
		t.Fatalf("%d functions another role may execute do not pin search_path:\n%s", len(bad), strings.Join(bad, "\n"))
	}
}
