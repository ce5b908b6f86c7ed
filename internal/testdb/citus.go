package testdb

import (
	"context"
	"database/sql"
	"os"
	"testing"

	"github.com/idemkit/idem/migrate"
)

// EnvCitusURL names the database on a Citus coordinator (with its workers
// added) that the opt-in Citus suite runs against (docs/citus.md).
const EnvCitusURL = "IDEM_TEST_CITUS_URL"

// Citus returns $IDEM_TEST_CITUS_URL with idem freshly migrated there and
// distributed: schema idem dropped on the coordinator and the workers,
// migrate.Up, migrate.Citus, and migrate.Citus once more doing nothing.
// Without the variable the test says it did not run, and why: this is the
// one opt-in suite (Citus is not in the archive CI installs from). Tests
// that use it share the database, so they run one at a time (go test -p 1).
func Citus(t testing.TB) string {
	t.Helper()
	url := os.Getenv(EnvCitusURL)
	if url == "" {
		t.Skip(EnvCitusURL + " is not set: the Citus suite did not run. It needs a Citus coordinator with workers; docs/citus.md says how to start one and run it.")
	}
	ctx := context.Background()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for _, q := range []string{
		`DROP SCHEMA IF EXISTS idem CASCADE`,
		// The workers' own counters are not distributed objects.
		`SELECT run_command_on_workers('DROP SCHEMA IF EXISTS idem CASCADE')`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Citus(ctx, db); err != nil {
		t.Fatal(err)
	}
	if done, err := migrate.Citus(ctx, db); err != nil || len(done) > 0 {
		t.Fatalf("migrate.Citus again: did %q, %v; want nothing", done, err)
	}
	return url
}
