// Package testdb gives tests a real PostgreSQL server.
//
// With IDEM_TEST_DATABASE_URL set, tests use that server (the role needs
// CREATEDB: every test gets a database of its own). Without it, Main starts
// a throwaway cluster (package pgcluster) and removes it when the tests
// end. When neither works, tests fail with a message that says how to get a
// server: a database test never skips.
package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

// EnvURL names the variable that points tests at an existing server.
const EnvURL = "IDEM_TEST_DATABASE_URL"

const howToGetOne = pgcluster.InstallHint + ", or set " + EnvURL + " to a server where the role may CREATE DATABASE"

// server is what Main set up: an admin connection string to a server.
var server struct {
	adminURL string             // connects to a maintenance database as a role that may create databases
	cluster  *pgcluster.Cluster // nil when EnvURL was used
	prefix   string             // database name prefix unique to this process
}

var (
	templateOnce sync.Once
	templateName string
	templateErr  error
	counter      atomic.Int64
)

// Main runs m against a real PostgreSQL server and exits. Call it from
// TestMain of every package whose tests use the database.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx := context.Background()
	server.prefix = fmt.Sprintf("idem_t%d_%d", os.Getpid(), rand.IntN(1e6))
	if u := os.Getenv(EnvURL); u != "" {
		server.adminURL = u
		if err := ping(ctx, u); err != nil {
			fmt.Fprintf(os.Stderr, "testdb: %s is set but the server cannot be reached: %v\n", EnvURL, err)
			return 1
		}
	} else {
		c, err := pgcluster.Start(ctx)
		if err != nil {
			fmt.Fprintf(os.Stderr, "testdb: these tests need a PostgreSQL server and none could be started: %v\nTo fix: %s.\n", err, howToGetOne)
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

func requireServer(t testing.TB) {
	t.Helper()
	if server.adminURL == "" {
		t.Fatalf("testdb: no server: call testdb.Main(m) from TestMain of this package. %s.", howToGetOne)
	}
}

// URLFor returns the connection string for database name on the test server.
func URLFor(t testing.TB, name string) string {
	requireServer(t)
	cfg, err := pgx.ParseConfig(server.adminURL)
	if err != nil {
		t.Fatalf("testdb: parse admin URL: %v", err)
	}
	return withDatabase(server.adminURL, cfg, name)
}

func withDatabase(adminURL string, cfg *pgx.ConnConfig, name string) string {
	if strings.Contains(adminURL, "://") {
		// URL form: replace the path.
		i := strings.Index(adminURL, "://")
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
	return adminURL + " dbname=" + name
}

// NewEmpty creates an empty database for t and drops it when t ends. It
// returns the database's connection string.
func NewEmpty(t testing.TB) string {
	t.Helper()
	requireServer(t)
	return create(t, "template0")
}

// New creates a database for t with idem's migrations applied and a test
// clock installed (see ClockParam), and drops it when t ends.
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

// Create is New for code without a testing.TB (Example functions): it
// returns the database's connection string and a function that drops it.
func Create() (url string, drop func() error, err error) {
	if server.adminURL == "" {
		return "", nil, fmt.Errorf("testdb: no server: call testdb.Main(m) from TestMain of this package. %s", howToGetOne)
	}
	templateOnce.Do(func() { templateName, templateErr = buildTemplate() })
	if templateErr != nil {
		return "", nil, fmt.Errorf("testdb: build template database: %w", templateErr)
	}
	return createFrom(templateName)
}

func create(t testing.TB, template string) string {
	t.Helper()
	url, drop, err := createFrom(template)
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

func createFrom(template string) (string, func() error, error) {
	ctx := context.Background()
	name := fmt.Sprintf("%s_%d", server.prefix, counter.Add(1))
	if err := execSQL(ctx, server.adminURL, fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s",
		pgx.Identifier{name}.Sanitize(), pgx.Identifier{template}.Sanitize())); err != nil {
		return "", nil, fmt.Errorf("testdb: create database: %w", err)
	}
	cfg, err := pgx.ParseConfig(server.adminURL)
	if err != nil {
		return "", nil, err
	}
	drop := func() error {
		if err := dropDatabase(context.Background(), name); err != nil {
			return fmt.Errorf("testdb: drop database %s: %w", name, err)
		}
		return nil
	}
	return withDatabase(server.adminURL, cfg, name), drop, nil
}

// buildTemplate makes the migrated template database that New copies. It is
// built once per process and has no open connections afterwards (CREATE
// DATABASE refuses a template that has any).
func buildTemplate() (string, error) {
	ctx := context.Background()
	name := server.prefix + "_tmpl"
	if err := execSQL(ctx, server.adminURL, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0"); err != nil {
		return "", err
	}
	cfg, err := pgx.ParseConfig(server.adminURL)
	if err != nil {
		return "", err
	}
	url := withDatabase(server.adminURL, cfg, name)
	db, err := sql.Open("pgx", url)
	if err != nil {
		return "", err
	}
	defer db.Close()
	if _, err := migrate.Up(ctx, db); err != nil {
		return "", fmt.Errorf("migrate up: %w", err)
	}
	if _, err := db.ExecContext(ctx, pgcluster.ClockOverrideSQL); err != nil {
		return "", fmt.Errorf("install test clock: %w", err)
	}
	return name, db.Close()
}

// ClockParam is the run-time parameter the test clock reads.
const ClockParam = pgcluster.ClockParam

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

// Pool opens a pool on url sized for racing tests and closes it when t ends.
func Pool(t testing.TB, url string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("testdb: parse %q: %v", url, err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// PoolAt is Pool whose sessions live at the given time, as far as idem's
// test clock is concerned (idem.clock() returns at instead of the time).
func PoolAt(t testing.TB, url string, maxConns int32, at time.Time) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("testdb: parse %q: %v", url, err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	cfg.ConnConfig.RuntimeParams[ClockParam] = at.UTC().Format(time.RFC3339Nano)
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: pool: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// MonthStart is the first instant of the UTC month add months after t's.
func MonthStart(t time.Time, add int) time.Time {
	t = t.UTC()
	return time.Date(t.Year(), t.Month()+time.Month(add), 1, 0, 0, 0, 0, time.UTC)
}

// AsUser is dsn (a URL or a keyword/value string) connecting as role.
func AsUser(dsn, role string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.User = url.User(role)
		return u.String()
	}
	return dsn + " user=" + role
}
