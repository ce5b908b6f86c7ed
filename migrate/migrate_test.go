package migrate_test

import (
	"context"
	"database/sql"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// appMigrations is an application's own goose history: its own version
// table in public and a hand-made processed_events like the seeds show.
var appMigrations = fstest.MapFS{
	"00001_app.sql": {Data: []byte(`-- +goose Up
CREATE TABLE public.processed_events (
    event_id     text PRIMARY KEY,
    processed_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO public.processed_events (event_id) VALUES ('evt_app_1'), ('evt_app_2');
-- +goose Down
DROP TABLE public.processed_events;
`)},
}

func setup(t *testing.T) (*sql.DB, context.Context) {
	t.Helper()
	db, err := sql.Open("pgx", testdb.NewEmpty(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	return db, context.Background()
}

// snapshot renders what the application owns, to compare before and after.
func snapshot(t *testing.T, ctx context.Context, db *sql.DB) string {
	t.Helper()
	var s string
	err := db.QueryRowContext(ctx, `
		SELECT (SELECT string_agg(version_id::text || ':' || is_applied::text, ',' ORDER BY id) FROM public.goose_db_version)
		    || '|' || (SELECT string_agg(event_id, ',' ORDER BY event_id) FROM public.processed_events)
		    || '|' || (SELECT string_agg(column_name || ' ' || data_type, ',' ORDER BY ordinal_position)
		                 FROM information_schema.columns WHERE table_schema = 'public' AND table_name = 'processed_events')`).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestMigrationsLeaveTheAppAlone(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	app, err := goose.NewProvider(goose.DialectPostgres, db, appMigrations)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.Up(ctx); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, ctx, db)

	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if res, err := p.Up(ctx); err != nil || len(res) == 0 {
		t.Fatalf("idem up: %v %v", res, err)
	}
	if got := snapshot(t, ctx, db); got != before {
		t.Fatalf("app state changed by idem's migrations:\nbefore %s\nafter  %s", before, got)
	}
	var token int64
	if err := db.QueryRowContext(ctx, `SELECT token FROM idem.claim('stripe', 'evt_app_1')`).Scan(&token); err != nil || token == 0 {
		t.Fatalf("claim after migrating: %v", err)
	}

	t.Run("up again is a no-op", func(t *testing.T) {
		res, err := p.Up(ctx)
		if err != nil || len(res) != 0 {
			t.Fatalf("second up: %d migrations applied, %v", len(res), err)
		}
	})
	t.Run("down and up round-trip", func(t *testing.T) {
		if _, err := p.DownTo(ctx, 0); err != nil {
			t.Fatal(err)
		}
		var objects int
		if err := db.QueryRowContext(ctx, `
			SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			         WHERE n.nspname = 'idem' AND c.relname <> 'goose_db_version' AND c.relname NOT LIKE 'goose_db_version%')
			     + (SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = 'idem')`).Scan(&objects); err != nil {
			t.Fatal(err)
		}
		if objects != 0 {
			t.Fatalf("%d idem objects left after down to 0", objects)
		}
		if got := snapshot(t, ctx, db); got != before {
			t.Fatalf("app state changed by idem's down migrations:\nbefore %s\nafter  %s", before, got)
		}
		if _, err := p.Up(ctx); err != nil {
			t.Fatal(err)
		}
		var outcome string
		if err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('stripe', 'evt_app_1')`).Scan(&outcome); err != nil || outcome != "acquired" {
			t.Fatalf("claim after down/up: %q %v", outcome, err)
		}
		// And the app's own goose still sees only its history.
		v, err := app.GetDBVersion(ctx)
		if err != nil || v != 1 {
			t.Fatalf("app goose version %d %v, want 1", v, err)
		}
	})
}

// TestConcurrentUp: several instances migrating at once are serialized by
// idem's advisory lock; all succeed and the schema is applied once.
func TestConcurrentUp(t *testing.T) {
	t.Parallel()
	db, ctx := setup(t)
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := migrate.Up(ctx, db)
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM idem.goose_db_version WHERE version_id > 0`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	p, _ := migrate.NewProvider(db)
	if want := len(p.ListSources()); n != want {
		t.Fatalf("%d versions recorded, want %d", n, want)
	}
}
