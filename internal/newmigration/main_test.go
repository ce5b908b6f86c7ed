package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem/internal/schemadump"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

func TestMain(m *testing.M) { testdb.Main(m) }

const schemaDir = "../../sql/schema"

// A migration started by the command for idem.claim and idem.holds: its
// Up, applied unedited after every shipped migration, changes nothing (it
// holds today's definitions); one edit of its Up changes functions/claim.sql
// and nothing else; its Down restores the schema exactly as sql/schema
// holds it.
func TestNewMigrationStartsFromTodaysDefinitions(t *testing.T) {
	dir := t.TempDir()
	shipped, err := fs.ReadDir(migrate.FS(), ".")
	if err != nil {
		t.Fatal(err)
	}
	mapFS := fstest.MapFS{}
	for _, e := range shipped {
		b, err := fs.ReadFile(migrate.FS(), e.Name())
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
		mapFS[e.Name()] = &fstest.MapFile{Data: b}
	}
	path, err := Write(dir, schemaDir, "claim_example", []string{"idem.claim", "holds"})
	if err != nil {
		t.Fatal(err)
	}
	next := migrate.Latest() + 1
	if want := filepath.Join(dir, fmt.Sprintf("%05d_idem_claim_example.sql", next)); path != want {
		t.Fatalf("wrote %s, want %s", path, want)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	up, down, ok := strings.Cut(text, "-- +goose Down\n")
	if !ok || strings.Count(up, "CREATE OR REPLACE FUNCTION idem.claim(") != 1 || strings.Count(down, "CREATE OR REPLACE FUNCTION idem.claim(") != 1 {
		t.Fatalf("the migration does not hold idem.claim once in Up and once in Down:\n%s", text)
	}
	if !strings.Contains(up, "-- CREATE TABLE idem.holds (") {
		t.Errorf("Up does not show idem.holds' definition as a comment")
	}

	ctx := context.Background()
	url := testdb.NewEmpty(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	committed, err := schemadump.Read(schemaDir)
	if err != nil {
		t.Fatal(err)
	}
	// apply runs the shipped migrations and the new one (text) up, or the
	// new one down, and returns the schema's files afterwards.
	apply := func(text string, up bool) map[string]string {
		t.Helper()
		fsys := fstest.MapFS{}
		for k, v := range mapFS {
			fsys[k] = v
		}
		fsys[filepath.Base(path)] = &fstest.MapFile{Data: []byte(text)}
		if _, err := migrate.Up(ctx, db); err != nil {
			t.Fatal(err)
		}
		p, err := goose.NewProvider(goose.DialectPostgres, db, fsys,
			goose.WithTableName(migrate.TableName), goose.WithDisableGlobalRegistry(true))
		if err != nil {
			t.Fatal(err)
		}
		if up {
			_, err = p.Up(ctx)
		} else {
			_, err = p.Down(ctx)
		}
		if err != nil {
			t.Fatalf("goose %v: %v", map[bool]string{true: "up", false: "down"}[up], err)
		}
		return dump(t, ctx, conn)
	}

	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if err := schemadump.Check(schemaDir, dump(t, ctx, conn)); err != nil {
		t.Fatalf("the migration was started from sql/schema, which is stale: %v", err)
	}
	if d := schemadump.Diff(committed, apply(text, true)); len(d) > 0 {
		t.Fatalf("the unedited migration changed the schema:\n%s", strings.Join(d, "\n"))
	}
	if d := schemadump.Diff(committed, apply(text, false)); len(d) > 0 {
		t.Fatalf("its Down changed the schema:\n%s", strings.Join(d, "\n"))
	}
	const from, to = "idem.utc_month(v_now + interval '1 day')", "idem.utc_month(v_now + interval '2 days')"
	if !strings.Contains(up, from) {
		t.Fatalf("idem.claim has no %q to edit", from)
	}
	edited := strings.Replace(up, from, to, 1) + "-- +goose Down\n" + down
	d := schemadump.Diff(committed, apply(edited, true))
	if len(d) != 1 || !strings.HasPrefix(d[0], "differs:  functions/claim.sql") || !strings.Contains(d[0], "2 days") {
		t.Fatalf("the edited Up: want functions/claim.sql alone to differ, got:\n%s", strings.Join(d, "\n"))
	}
	if d := schemadump.Diff(committed, apply(edited, false)); len(d) > 0 {
		t.Fatalf("the Down did not restore the schema:\n%s", strings.Join(d, "\n"))
	}
}

func TestNewMigrationRefusesBadInput(t *testing.T) {
	dir := t.TempDir()
	if _, err := Write(dir, schemaDir, "Bad-Name", []string{"idem.claim"}); err == nil {
		t.Error("a name with capitals and a dash was accepted")
	}
	if _, err := Write(dir, schemaDir, "x", []string{"idem.no_such_thing"}); !errors.Is(err, ErrUnknownObject) {
		t.Errorf("an unknown object: %v, want ErrUnknownObject", err)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 0 {
		t.Errorf("a refused migration left files: %v", entries)
	}
}

func dump(t *testing.T, ctx context.Context, conn *pgx.Conn) map[string]string {
	t.Helper()
	files, err := schemadump.Dump(ctx, conn)
	if err != nil {
		t.Fatal(err)
	}
	return files
}
