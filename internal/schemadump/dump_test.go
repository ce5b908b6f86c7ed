package schemadump_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/schemadump"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// committed is sql/schema/ seen from this package's directory.
const committed = "../../sql/schema"

// migrated returns a new database migrated to the latest version, its dump,
// and a connection to it whose session has settings unlike the defaults
// (Dump must not depend on them).
func migrated(t *testing.T) (*pgx.Conn, map[string]string) {
	t.Helper()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, `SET search_path = idem, public; SET DateStyle = 'German, DMY'; SET TimeZone = 'Asia/Kathmandu'; SET IntervalStyle = 'sql_standard'`); err != nil {
		t.Fatal(err)
	}
	files, err := schemadump.Migrated(ctx, db, conn)
	if err != nil {
		t.Fatal(err)
	}
	return conn, files
}

// The committed sql/schema/ is what the migrations produce: the check that
// `make schema-check` runs in CI, here with a session whose search_path,
// DateStyle, TimeZone and IntervalStyle are not the defaults.
func TestCommittedSchemaIsCurrent(t *testing.T) {
	_, files := migrated(t)
	if err := schemadump.Check(committed, files); err != nil {
		t.Fatal(err)
	}
	for path, text := range files {
		for _, bad := range []string{"/tmp/", "/work/", "/home/", "/root/"} {
			if strings.Contains(text, bad) {
				t.Errorf("%s holds %q", path, bad)
			}
		}
	}
}

// A migration that changes an object while its committed file stays as it
// was fails the check, naming the file and saying what to run; so does a
// migration that drops an object whose file is still there.
func TestCheckFailsWhenAnObjectChanges(t *testing.T) {
	conn, _ := migrated(t)
	ctx := context.Background()
	if _, err := conn.Exec(ctx, `
		CREATE OR REPLACE FUNCTION idem.valid_ttl(ttl interval) RETURNS boolean
		    LANGUAGE sql IMMUTABLE PARALLEL SAFE
		AS $$ SELECT ttl >= interval '1 second' AND ttl <= interval '10 years' $$;
		DROP FUNCTION idem.days_at_most(interval)`); err != nil {
		t.Fatal(err)
	}
	files, err := schemadump.Dump(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	err = schemadump.Check(committed, files)
	if !errors.Is(err, schemadump.ErrStale) {
		t.Fatalf("Check after changing idem.valid_ttl: %v, want ErrStale", err)
	}
	for _, want := range []string{"make schema", "differs:  functions/valid_ttl.sql", "1 second", "stale:    functions/days_at_most.sql"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Check's error does not say %q:\n%v", want, err)
		}
	}
	t.Logf("the check's message:\n%v", err)
}
