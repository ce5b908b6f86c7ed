package cli

import (
	"github.com/idemkit/idem/internal/sqlstate"

	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"regexp"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/internal/maintcfg"
	"github.com/idemkit/idem/migrate"
)

// resolveURL picks the connection string: --database-url, then
// DATABASE_URL, then "" (pgx reads the libpq PG* variables itself).
func (g *globals) resolveURL(env Env) string {
	if g.databaseURL != "" {
		return g.databaseURL
	}
	return env("DATABASE_URL")
}

// poolConfig parses the connection string and applies the timeouts.
func (g *globals) poolConfig(env Env) (*pgxpool.Config, error) {
	raw := g.resolveURL(env)
	cfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		return nil, usageErr("invalid database URL (from %s): %s", g.urlSource(env), redact(err.Error()))
	}
	if g.lockTimeout < 0 || g.statementTimeout < 0 {
		return nil, usageErr("--lock-timeout and --statement-timeout must not be negative")
	}
	// PostgreSQL takes whole milliseconds up to its limit, 0 meaning none:
	// 500us would be no timeout at all, 1000h an error at every run.
	for _, t := range []struct {
		flag string
		d    time.Duration
	}{{"--lock-timeout", g.lockTimeout}, {"--statement-timeout", g.statementTimeout}} {
		if t.d > maintcfg.MaxTimeout || (t.d > 0 && t.d < time.Millisecond) {
			return nil, usageErr("%s %s is out of range (1ms to %s, PostgreSQL's limit)", t.flag, t.d, maintcfg.MaxTimeout)
		}
	}
	// Only application_name goes in the startup packet (PgBouncer passes it
	// on); the timeouts are set per transaction by prune and rotation, since
	// session settings do not survive transaction pooling.
	// With pgx's exec or simple protocol mode (the setting docs/idemctl.md
	// gives for PgBouncer before 1.21) results come back as text, which
	// pgx reads in the ISO date style only: the session's DateStyle is
	// set to ISO (PgBouncer passes DateStyle on), unless the URL sets one.
	if m := cfg.ConnConfig.DefaultQueryExecMode; m == pgx.QueryExecModeExec || m == pgx.QueryExecModeSimpleProtocol {
		if _, ok := cfg.ConnConfig.RuntimeParams["DateStyle"]; !ok {
			cfg.ConnConfig.RuntimeParams["DateStyle"] = "ISO, YMD"
		}
	}
	if _, ok := cfg.ConnConfig.RuntimeParams["application_name"]; !ok {
		cfg.ConnConfig.RuntimeParams["application_name"] = "idemctl"
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = 10 * time.Second
	}
	return cfg, nil
}

func (g *globals) urlSource(env Env) string {
	switch {
	case g.databaseURL != "":
		return "--database-url"
	case env("DATABASE_URL") != "":
		return "DATABASE_URL"
	}
	return "PG* environment variables"
}

// connect opens a pool and proves the database answers, mapping failures
// to exit codes with a one-line reason. tweak, when given, adjusts the
// configuration first.
func (g *globals) connect(ctx context.Context, env Env, maxConns int32, tweak ...func(*pgxpool.Config)) (*pgxpool.Pool, error) {
	cfg, err := g.poolConfig(env)
	if err != nil {
		return nil, err
	}
	for _, t := range tweak {
		t(cfg)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, usageErr("%s", redact(err.Error()))
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.ConnConfig.ConnectTimeout+time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, connectErr(cfg.ConnConfig, err)
	}
	return pool, nil
}

// connectErr explains why a connection failed.
func connectErr(cc *pgx.ConnConfig, err error) error {
	where := net.JoinHostPort(cc.Host, fmt.Sprint(cc.Port))
	if strings.HasPrefix(cc.Host, "/") {
		where = fmt.Sprintf("socket %s/.s.PGSQL.%d", cc.Host, cc.Port)
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		switch pg.Code {
		case sqlstate.InvalidPassword, sqlstate.InvalidAuthorization:
			return withCode(ExitUnreachable, fmt.Errorf("the database at %s refused login for user %q: %s (check the user and password in the database URL)", where, cc.User, pg.Message))
		case sqlstate.InvalidCatalogName:
			return withCode(ExitUnreachable, fmt.Errorf("database %q does not exist at %s", cc.Database, where))
		case sqlstate.InsufficientPrivilege:
			return withCode(ExitUnreachable, fmt.Errorf("user %q may not connect to database %q at %s: %s", cc.User, cc.Database, where, pg.Message))
		}
	}
	return withCode(ExitUnreachable, fmt.Errorf("cannot reach the database at %s: %s (check --database-url or DATABASE_URL, and that the server is up)",
		where, redact(cause(err))))
}

// cause is the most useful part of a connection error: the network
// error when there is one ("connect: connection refused").
func cause(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err.Error()
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return dns.Error()
	}
	return err.Error()
}

// connectMigrated is connect for commands that need idem's schema.
func (g *globals) connectMigrated(ctx context.Context, env Env, maxConns int32) (*pgxpool.Pool, error) {
	pool, err := g.connect(ctx, env, maxConns)
	if err != nil {
		return nil, err
	}
	if err := requireMigrated(ctx, pool); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// requireMigrated fails with ExitNotMigrated unless idem's schema is there.
func requireMigrated(ctx context.Context, pool *pgxpool.Pool) error {
	var ok bool
	err := pool.QueryRow(ctx, `SELECT to_regclass('idem.processed_events') IS NOT NULL
	                              AND to_regprocedure('idem.claim(text,text,text,interval,interval,text,interval)') IS NOT NULL`).Scan(&ok)
	if err != nil {
		return withCode(ExitError, fmt.Errorf("check for schema idem: %w", err))
	}
	if !ok {
		return withCode(ExitNotMigrated, errors.New("schema idem is not installed in this database, or is older than this idemctl: run `idemctl migrate up` first"))
	}
	// Behind this build: its statements may need what a later migration
	// adds. (A role that may not read the version table is not stopped
	// here; idem.grant_app and grant_maintainer give it that right.)
	var version int64
	if err := pool.QueryRow(ctx, `SELECT coalesce(max(version_id), 0) FROM idem.goose_db_version`).Scan(&version); err == nil && version < migrate.Latest() {
		return withCode(ExitNotMigrated, fmt.Errorf("schema idem is at version %d, and this idemctl needs version %d: run `idemctl migrate up` first", version, migrate.Latest()))
	}
	return nil
}

// sqlDB opens a database/sql handle on the same configuration (goose needs one).
func sqlDB(pool *pgxpool.Pool) *sql.DB {
	return stdlib.OpenDBFromPool(pool)
}

var passwordRE = regexp.MustCompile(`(?i)(password\s*=\s*)('[^']*'|\S+)`)

// redact removes passwords from text that may quote a connection string.
func redact(s string) string {
	s = passwordRE.ReplaceAllString(s, "${1}xxxxx")
	// URL form: scheme://user:password@host
	for _, f := range strings.Fields(s) {
		f = strings.Trim(f, "\"'`,;()")
		if i := strings.Index(f, "://"); i > 0 {
			if u, err := url.Parse(f); err == nil && u.User != nil {
				if _, has := u.User.Password(); has {
					u.User = url.UserPassword(u.User.Username(), "xxxxx")
					s = strings.ReplaceAll(s, f, u.String())
				}
			}
		}
	}
	return s
}
