// Package migrate applies idem's embedded migrations with goose's Provider
// API. idem keeps its own goose history in idem.goose_db_version and takes
// its own advisory lock (in each step's transaction, so it holds through a
// transaction pooler), so an application's goose_db_version, its lock and
// its tables are never touched.
//
//	p, err := migrate.NewProvider(db) // db is a *sql.DB (pgx stdlib driver)
//	_, err = p.Up(ctx)
package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"strconv"
	"strings"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"

	"github.com/idemkit/idem/sql/migrations"
)

const (
	// Schema is the schema every idem object lives in.
	Schema = "idem"
	// TableName is idem's goose version table.
	TableName = Schema + ".goose_db_version"
	// LockID is the advisory lock id that serializes concurrent migrations
	// of idem: each step takes it for its transaction (steps.go). goose's
	// default id is 4097083626; idem's differs so that an application's own
	// goose run does not wait on idem's or the reverse. idem's advisory
	// lock ids are the four bytes "idem" read as a big-endian integer,
	// 0x6964656D = 1768187245, plus a small offset:
	// +0 a key's lock in idem.claim (two-key form, with the key's hash),
	// +1 this migration lock, +2 the gate of the maintenance locks (two-key
	// form, with the lock name's hash), +3 River's migrations
	// (inbox.MigrateLockID), +4 OnlineLockID.
	LockID int64 = 1768187246
	// OnlineLockID serializes the online index builds of migrators
	// (online.go).
	OnlineLockID = LockID + 3
)

// FS returns the embedded migrations.
func FS() fs.FS { return migrations.FS }

// Latest is the version of the newest embedded migration: the schema this
// build of idem needs.
func Latest() int64 {
	entries, _ := fs.ReadDir(migrations.FS, ".")
	var v int64
	for _, e := range entries {
		num, _, ok := strings.Cut(e.Name(), "_")
		if n, err := strconv.ParseInt(num, 10, 64); ok && err == nil && strings.HasSuffix(e.Name(), ".sql") {
			v = max(v, n)
		}
	}
	return v
}

// NewProvider returns a goose Provider over idem's embedded migrations with
// idem's version table, each step guarded as steps.go says (the migration
// lock of the step's transaction, DefaultLockTimeout). Extra options are
// appended (for example goose.WithSlog). The schema is created, if missing,
// when goose creates its version table. Its Up and Down do not retry: a
// step that timed out on a lock fails, and so does a step that a racing
// migrator applied first (SQLSTATE sqlstate.MigrationStepDone; run it
// again). Nor do they build an index on idem.processed_events online
// before the step that creates it (online.go): the step's CREATE INDEX
// builds it, holding every claim for the build. New returns a Migrator,
// which does both and builds online; Up and DownTo use it.
func NewProvider(db *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	cfg, err := Config{}.withDefaults()
	if err != nil {
		return nil, err
	}
	p, _, err := newProvider(db, cfg, opts...)
	return p, err
}

// newProvider returns the Provider and the indexes on idem.processed_events
// its steps create, which the Migrator builds online first (online.go).
func newProvider(db *sql.DB, cfg Config, opts ...goose.ProviderOption) (*goose.Provider, map[onlineKey][]onlineIndex, error) {
	if db == nil {
		return nil, nil, errors.New("idem/migrate: db must not be nil")
	}
	base, err := database.NewStore(database.DialectPostgres, TableName)
	if err != nil {
		return nil, nil, fmt.Errorf("idem/migrate: %w", err)
	}
	fsys, online, err := guardedFS(cfg.LockTimeout, cfg.stepProbe != nil)
	if err != nil {
		return nil, nil, err
	}
	all := append([]goose.ProviderOption{
		goose.WithStore(schemaStore{Store: base, probe: cfg.stepProbe}),
		goose.WithDisableGlobalRegistry(true),
	}, opts...)
	p, err := goose.NewProvider(goose.DialectCustom, db, fsys, all...)
	if err != nil {
		return nil, nil, fmt.Errorf("idem/migrate: %w", err)
	}
	return p, online, nil
}

// StoredKeys counts the keys a migration down to version 0 would drop
// (0 when idem is not installed).
func StoredKeys(ctx context.Context, db *sql.DB) (int64, error) {
	var n int64
	err := db.QueryRowContext(ctx, `SELECT CASE WHEN to_regclass('idem.processed_events') IS NULL THEN 0
	                                            ELSE (SELECT count(*) FROM idem.processed_events) END`).Scan(&n)
	return n, err
}

// DownTo migrates down to version. A down that would drop stored state
// (keys, inbox holds, an adoption, policies' settings, run history) is
// refused with ErrWouldDropKeys or ErrWouldLoseState, saying what would be
// lost, unless force is set (GuardDown).
func DownTo(ctx context.Context, db *sql.DB, version int64, force bool) ([]*goose.MigrationResult, error) {
	m, err := New(db, Config{})
	if err != nil {
		return nil, err
	}
	return m.DownTo(ctx, version, force)
}

// Up applies every pending migration, each step with Config's default lock
// bounds (New for others). Re-running it is a no-op. On a
// distributed installation (Citus ran before) it then runs Citus again,
// which does nothing when nothing needs doing: a migration that replaces a
// per-key function resets what Citus needs of it (migration 13 and later
// do that in their own transaction; this covers any that does not).
func Up(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	m, err := New(db, Config{})
	if err != nil {
		return nil, err
	}
	res, err := m.Up(ctx)
	if err != nil {
		return res, err
	}
	if d, err := Distributed(ctx, db); err != nil || !d {
		return res, err
	}
	if _, err := Citus(ctx, db); err != nil {
		return res, err
	}
	return res, nil
}

// ErrSchemaInUse: schema idem exists, holds objects, and has no idem
// version table: it is somebody else's schema, and installing into it
// would mix idem's objects and privileges with theirs.
var ErrSchemaInUse = errors.New("idem/migrate: schema idem already exists and holds objects idem did not create")

// ErrWouldDropKeys: a down migration to before version 1 would drop the
// stored keys (and with them every duplicate's protection); see DownTo.
var ErrWouldDropKeys = errors.New("idem/migrate: migrating down to version 0 would drop every stored key")

// schemaStore is goose's Postgres store, but it creates schema idem before
// creating the version table inside it (refusing a schema idem that is
// somebody else's), and after every migration applied or rolled back it
// takes EXECUTE on schema idem's routines away from PUBLIC, in the same
// transaction. PostgreSQL cannot do that with default privileges per
// schema (a per-schema REVOKE does not remove the global default that lets
// PUBLIC execute new functions), so this is where a routine added by a
// later migration, or re-created by a Down (version 3's Down granted
// EXECUTE to PUBLIC), is kept off PUBLIC.
type schemaStore struct {
	database.Store
	probe stepProbe // tests only: nil
}

// revokePublic is run after each migration step.
const revokePublic = "REVOKE ALL ON ALL ROUTINES IN SCHEMA " + Schema + " FROM PUBLIC"

func (s schemaStore) CreateVersionTable(ctx context.Context, db database.DBTxConn) error {
	var rels, routines int
	err := db.QueryRowContext(ctx, `
		SELECT (SELECT count(*) FROM pg_catalog.pg_class c WHERE c.relnamespace = n.oid),
		       (SELECT count(*) FROM pg_catalog.pg_proc p WHERE p.pronamespace = n.oid)
		  FROM pg_catalog.pg_namespace n WHERE n.nspname = $1`, Schema).Scan(&rels, &routines)
	switch {
	case errors.Is(err, sql.ErrNoRows):
	case err != nil:
		return fmt.Errorf("look for schema %s: %w", Schema, err)
	case rels+routines > 0:
		return fmt.Errorf("%w (%d relations, %d routines, no idem.goose_db_version): idem installs into a schema of its own; "+
			"rename yours (ALTER SCHEMA idem RENAME TO ...) or drop it, then migrate again", ErrSchemaInUse, rels, routines)
	}
	// An empty schema idem made by someone else keeps its owner and grants.
	if err := CheckSchema(ctx, db); err != nil {
		return err
	}
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+Schema); err != nil {
		return fmt.Errorf("create schema %s: %w", Schema, err)
	}
	return s.Store.CreateVersionTable(ctx, db)
}

func (s schemaStore) Insert(ctx context.Context, db database.DBTxConn, req database.InsertRequest) error {
	if s.probe != nil && req.Version > 0 { // version 0: the version table's own row
		if err := s.probe(ctx, db, req.Version, true); err != nil {
			return err
		}
	}
	if err := s.Store.Insert(ctx, db, req); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, revokePublic)
	return err
}

func (s schemaStore) Delete(ctx context.Context, db database.DBTxConn, version int64) error {
	if s.probe != nil {
		if err := s.probe(ctx, db, version, false); err != nil {
			return err
		}
	}
	if err := s.Store.Delete(ctx, db, version); err != nil {
		return err
	}
	_, err := db.ExecContext(ctx, revokePublic)
	return err
}

func (s schemaStore) TableExists(ctx context.Context, db database.DBTxConn) (bool, error) {
	if ext, ok := s.Store.(database.StoreExtender); ok {
		return ext.TableExists(ctx, db)
	}
	return false, errors.ErrUnsupported
}

var discardLogger = slog.New(slog.DiscardHandler)
