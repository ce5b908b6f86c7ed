// Package testpg gives your tests a real, migrated, throwaway PostgreSQL
// database: one per test, with idem's migrations applied, dropped when the
// test ends.
//
// The server is the one $IDEM_TEST_DATABASE_URL names (its role needs
// CREATEDB: every test gets a database of its own), or, without it, a
// throwaway cluster that Main starts from the local PostgreSQL server
// binaries (IDEM_PG_BINDIR, `pg_config --bindir`, PATH,
// /usr/lib/postgresql/*/bin) and removes when the tests end. When neither
// works, tests fail with a message that says how to get a server: they
// never skip.
//
//	func TestMain(m *testing.M) { testpg.Main(m) }
//
//	func TestReceiver(t *testing.T) {
//		pool := testpg.Pool(t, testpg.New(t), 8)
//		...
//	}
//
// idem's own tests use it too (through internal/testdb).
package testpg

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx", for the migrations

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

// EnvURL names the variable that points tests at an existing server.
const EnvURL = "IDEM_TEST_DATABASE_URL"

const howToGetOne = pgcluster.InstallHint + ", or set " + EnvURL + " to a server where the role may CREATE DATABASE"

// Option adjusts Main.
type Option func(*settings)

type settings struct {
	setup []func(ctx context.Context, db *sql.DB) error
}

// Setup runs f once on the migrated template database that New copies, so
// every database New returns has what f made (your own tables and
// migrations, for example).
func Setup(f func(ctx context.Context, db *sql.DB) error) Option {
	return func(s *settings) { s.setup = append(s.setup, f) }
}

// server is what Main set up.
var server struct {
	adminURL string             // a maintenance database, as a role that may create databases
	cluster  *pgcluster.Cluster // nil when EnvURL was used
	prefix   string             // database name prefix unique to this process
	settings settings
}

var (
	templateOnce sync.Once
	templateName string
	templateErr  error
	counter      atomic.Int64
)

// Main runs m against a PostgreSQL server and exits. Call it from TestMain
// of every package whose tests use New or NewEmpty.
func Main(m *testing.M, opts ...Option) {
	os.Exit(Run(m, opts...))
}

// Run is Main without the exit: it returns m's exit code, after removing
// the throwaway server.
func Run(m *testing.M, opts ...Option) int {
	ctx := context.Background()
	for _, o := range opts {
		o(&server.settings)
	}
	server.prefix = fmt.Sprintf("idem_t%d_%d", os.Getpid(), rand.IntN(1e6))
	if u := os.Getenv(EnvURL); u != "" {
		server.adminURL = u
		if err := ping(ctx, u); err != nil {
			fmt.Fprintf(os.Stderr, "testpg: %s is set but the server cannot be reached: %v\n", EnvURL, err)
			return 1
		}
	} else {
		c, err := pgcluster.Start(ctx)
		if err != nil {
			if errors.Is(err, pgcluster.ErrNotInstalled) {
				fmt.Fprintf(os.Stderr, "testpg: these tests need a PostgreSQL server and none could be started: %v\nTo fix: %s.\n", err, howToGetOne)
			} else {
				fmt.Fprintf(os.Stderr, "testpg: the throwaway PostgreSQL server did not start: %v\n", err)
			}
			return 1
		}
		server.cluster = c
		server.adminURL = c.URL("postgres")
	}
	code := m.Run()
	if templateName != "" {
		_ = dropDatabase(ctx, templateName)
	}
	if server.cluster != nil {
		server.cluster.Stop()
	}
	return code
}

func ping(ctx context.Context, url string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	return conn.Close(ctx)
}

func errNoServer() error {
	return fmt.Errorf("testpg: no server: call testpg.Main(m) from TestMain of this package. %s", howToGetOne)
}

// AdminURL is the connection string of the server's maintenance database,
// as a role that may create databases; "" before Main.
func AdminURL() string { return server.adminURL }

// URLFor returns the connection string for database name on the server.
func URLFor(t testing.TB, name string) string {
	t.Helper()
	if server.adminURL == "" {
		t.Fatal(errNoServer())
	}
	return withDatabase(server.adminURL, name)
}

func withDatabase(adminURL, name string) string {
	if i := strings.Index(adminURL, "://"); i >= 0 {
		// URL form: replace the path.
		rest := adminURL[i+3:]
		q := ""
		if j := strings.IndexByte(rest, '?'); j >= 0 {
			rest, q = rest[:j], rest[j:]
		}
		if j := strings.IndexByte(rest, '/'); j >= 0 {
			rest = rest[:j]
		}
		return adminURL[:i+3] + rest + "/" + name + q
	}
	return adminURL + " dbname=" + name // a later keyword wins
}

// New creates a database for t with idem's migrations applied (and what
// Setup made), drops it when t ends, and returns its connection string.
func New(t testing.TB) string {
	t.Helper()
	url, drop, err := Create()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Errorf("%v", err)
		}
	})
	return url
}

// NewEmpty creates an empty database for t (no migrations), drops it when
// t ends, and returns its connection string.
func NewEmpty(t testing.TB) string {
	t.Helper()
	if server.adminURL == "" {
		t.Fatal(errNoServer())
	}
	url, drop, err := createFrom("template0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Errorf("%v", err)
		}
	})
	return url
}

// Create is New for code without a testing.TB (Example functions): it
// returns the database's connection string and a function that drops it.
func Create() (url string, drop func() error, err error) {
	if server.adminURL == "" {
		return "", nil, errNoServer()
	}
	templateOnce.Do(func() { templateName, templateErr = buildTemplate() })
	if templateErr != nil {
		return "", nil, fmt.Errorf("testpg: build the template database: %w", templateErr)
	}
	return createFrom(templateName)
}

func createFrom(template string) (string, func() error, error) {
	ctx := context.Background()
	name := fmt.Sprintf("%s_%d", server.prefix, counter.Add(1))
	if err := execSQL(ctx, server.adminURL, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s",
		pgx.Identifier{name}.Sanitize(), pgx.Identifier{template}.Sanitize())); err != nil {
		return "", nil, fmt.Errorf("testpg: create database: %w", err)
	}
	drop := func() error {
		if err := dropDatabase(context.Background(), name); err != nil {
			return fmt.Errorf("testpg: drop database %s: %w", name, err)
		}
		return nil
	}
	return withDatabase(server.adminURL, name), drop, nil
}

// buildTemplate makes the migrated template database that New copies. It
// is built once per process and has no open connections afterwards
// (CREATE DATABASE refuses a template that has any).
func buildTemplate() (string, error) {
	ctx := context.Background()
	name := server.prefix + "_tmpl"
	if err := execSQL(ctx, server.adminURL, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0"); err != nil {
		return "", err
	}
	db, err := sql.Open("pgx", withDatabase(server.adminURL, name))
	if err != nil {
		return "", err
	}
	defer db.Close()
	if _, err := migrate.Up(ctx, db); err != nil {
		return "", fmt.Errorf("migrate up: %w", err)
	}
	for _, f := range server.settings.setup {
		if err := f(ctx, db); err != nil {
			return "", fmt.Errorf("setup: %w", err)
		}
	}
	return name, db.Close()
}

func execSQL(ctx context.Context, url, sql string) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

func dropDatabase(ctx context.Context, name string) error {
	return execSQL(ctx, server.adminURL, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// Pool opens a pool of at most maxConns connections (0: pgx's default) on
// url and closes it when t ends.
func Pool(t testing.TB, url string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("testpg: parse the connection string: %v", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testpg: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}
