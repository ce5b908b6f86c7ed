package migrate_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/migrate"
)

// publicRoutines lists the routines of schema idem that PUBLIC may execute.
func publicRoutines(t *testing.T, ctx context.Context, db *sql.DB) []string {
	t.Helper()
	return queryStrings(t, ctx, db, `
		SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		 WHERE n.nspname = 'idem' AND has_function_privilege('public', p.oid, 'EXECUTE') ORDER BY 1`)
}

// queryStrings runs q and returns its one text column, row by row.
func queryStrings(t *testing.T, ctx context.Context, db *sql.DB, q string, args ...any) []string {
	t.Helper()
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		out = append(out, s)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// TestPrivilegeModel: no routine of schema idem is ever executable by
// PUBLIC: not after install, not after a down whose SQL grants to PUBLIC
// (version 3's), not for a routine a later migration forgets to revoke;
// an application role can never take the maintenance locks; down then up
// keeps the model.
func TestPrivilegeModel(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	app := fmt.Sprintf("idem_priv_app_%d", time.Now().UnixNano())
	for _, q := range []string{`CREATE ROLE ` + app, `SELECT idem.grant_app('` + app + `')`} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), `DROP OWNED BY `+app)
		_, _ = db.ExecContext(context.Background(), `DROP ROLE `+app)
	})
	appCannotLock := func(stage string) {
		t.Helper()
		var can bool
		if err := db.QueryRowContext(ctx, `SELECT has_function_privilege($1, 'idem.try_lock(text,text,interval)', 'EXECUTE')
		                                       OR has_function_privilege($1, 'idem.prune_batch(text,integer)', 'EXECUTE')`, app).Scan(&can); err != nil || can {
			t.Fatalf("%s: the application role may take the maintenance locks (%v)", stage, err)
		}
	}
	check := func(stage string) {
		t.Helper()
		if pub := publicRoutines(t, ctx, db); len(pub) > 0 {
			t.Fatalf("%s: PUBLIC may execute %v", stage, pub)
		}
		appCannotLock(stage)
	}
	check("after install")

	// Version 3's Down grants EXECUTE on every routine to PUBLIC.
	if _, err := p.DownTo(ctx, 2); err != nil {
		t.Fatal(err)
	}
	check("down to version 2")
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	check("down and up again")

	// A routine a later migration forgets to revoke: the next migration
	// step takes it off PUBLIC.
	if _, err := db.ExecContext(ctx, `CREATE FUNCTION idem.forgotten() RETURNS int LANGUAGE sql AS 'SELECT 1'`); err != nil {
		t.Fatal(err)
	}
	if pub := publicRoutines(t, ctx, db); len(pub) != 1 || pub[0] != "idem.forgotten()" {
		t.Fatalf("the setup: %v", pub)
	}
	if _, err := p.Down(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	check("a routine created without a REVOKE, then a migration step")
}

// TestDownRefusesToDropKeys: a down to version 0 while keys are stored is
// refused, saying how many; with force it goes ahead.
func TestDownRefusesToDropKeys(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('s', 'k' || g) FROM generate_series(1, 7) g`); err != nil {
		t.Fatal(err)
	}
	_, err := migrate.DownTo(ctx, db, 0, false)
	if !errors.Is(err, migrate.ErrWouldDropKeys) || !strings.Contains(err.Error(), "7 keys are stored") {
		t.Fatalf("down to 0 with 7 keys: %v", err)
	}
	if n, err := migrate.StoredKeys(ctx, db); err != nil || n != 7 {
		t.Fatalf("after the refusal: %d keys (%v)", n, err)
	}
	if _, err := migrate.DownTo(ctx, db, 1, false); err != nil {
		t.Fatalf("down to 1 keeps the keys and is allowed: %v", err)
	}
	if _, err := migrate.DownTo(ctx, db, 0, true); err != nil {
		t.Fatalf("down to 0 with force: %v", err)
	}
}

// TestForeignSchemaRefused: a database that already has a schema idem of
// its own (a user's functions) is refused, and the user's schema is left
// exactly as it was.
func TestForeignSchemaRefused(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA idem; CREATE FUNCTION idem.mine() RETURNS int LANGUAGE sql AS 'SELECT 42'`); err != nil {
		t.Fatal(err)
	}
	_, err := migrate.Up(ctx, db)
	if !errors.Is(err, migrate.ErrSchemaInUse) || !strings.Contains(err.Error(), "1 routines") {
		t.Fatalf("migrate up into a user's schema idem: %v", err)
	}
	var pub bool
	var tables int
	if err := db.QueryRowContext(ctx, `SELECT has_function_privilege('public', 'idem.mine()', 'EXECUTE'),
	                                          (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'idem')`).Scan(&pub, &tables); err != nil {
		t.Fatal(err)
	}
	if !pub || tables != 0 {
		t.Fatalf("the user's schema was changed: PUBLIC execute %v, %d relations created", pub, tables)
	}
	// An empty schema idem made beforehand (a DBA's least-privilege setup)
	// is fine.
	if _, err := db.ExecContext(ctx, `DROP FUNCTION idem.mine()`); err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatalf("migrate up into an empty schema idem: %v", err)
	}
}
