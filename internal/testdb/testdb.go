// Package testdb gives idem's tests a real PostgreSQL server: the public
// helper's (package testpg: IDEM_TEST_DATABASE_URL, or a throwaway cluster
// from the local server binaries; a database test never skips), with
// idem's test clock in every migrated database, and what only idem's own
// tests need (PgBouncer, Citus, Chromium, hostile roles).
package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/testpg"
)

// EnvURL names the variable that points tests at an existing server.
const EnvURL = testpg.EnvURL

// Main runs m against a real PostgreSQL server and exits. Call it from
// TestMain of every package whose tests use the database. The server and
// the databases are package testpg's (the public helper), with idem's test
// clock (ClockParam) installed in the template New copies.
func Main(m *testing.M) {
	os.Exit(testpg.Run(m, testpg.Setup(func(ctx context.Context, db *sql.DB) error {
		if _, err := db.ExecContext(ctx, pgcluster.ClockOverrideSQL); err != nil {
			return fmt.Errorf("install test clock: %w", err)
		}
		return nil
	})))
}

// URLFor returns the connection string for database name on the test server.
func URLFor(t testing.TB, name string) string {
	t.Helper()
	return testpg.URLFor(t, name)
}

// NewEmpty creates an empty database for t and drops it when t ends. It
// returns the database's connection string.
func NewEmpty(t testing.TB) string {
	t.Helper()
	return testpg.NewEmpty(t)
}

// New creates a database for t with idem's migrations applied and a test
// clock installed (see ClockParam), and drops it when t ends.
func New(t testing.TB) string {
	t.Helper()
	return testpg.New(t)
}

// Create is New for code without a testing.TB (Example functions): it
// returns the database's connection string and a function that drops it.
func Create() (url string, drop func() error, err error) { return testpg.Create() }

// ClockParam is the run-time parameter the test clock reads.
const ClockParam = pgcluster.ClockParam

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
