// Package migrate applies idem's embedded migrations with goose's Provider
// API. idem keeps its own goose history in idem.goose_db_version and takes
// its own advisory lock, so an application's goose_db_version, its lock and
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

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"

	"github.com/idemkit/idem/sql/migrations"
)

const (
	// Schema is the schema every idem object lives in.
	Schema = "idem"
	// TableName is idem's goose version table.
	TableName = Schema + ".goose_db_version"
	// LockID is the session advisory lock id that serializes concurrent
	// migrations of idem (goose's default id is 4097083626; idem's differs so
	// that an application's own goose run does not wait on idem's or the
	// reverse). It is crc64("idem.migrations") truncated to 31 bits.
	LockID int64 = 1768187246
)

// FS returns the embedded migrations.
func FS() fs.FS { return migrations.FS }

// NewProvider returns a goose Provider over idem's embedded migrations with
// idem's version table and advisory session lock. Extra options are appended
// (for example goose.WithSlog). The schema is created, if missing, when goose
// creates its version table.
func NewProvider(db *sql.DB, opts ...goose.ProviderOption) (*goose.Provider, error) {
	if db == nil {
		return nil, errors.New("idem/migrate: db must not be nil")
	}
	base, err := database.NewStore(database.DialectPostgres, TableName)
	if err != nil {
		return nil, fmt.Errorf("idem/migrate: %w", err)
	}
	locker, err := lock.NewPostgresSessionLocker(
		lock.WithLockID(LockID),
		// Poll every second for up to 10 minutes: another instance may be
		// migrating; waiting is right, failing fast is not.
		lock.WithLockTimeout(1, 600),
	)
	if err != nil {
		return nil, fmt.Errorf("idem/migrate: %w", err)
	}
	all := append([]goose.ProviderOption{
		goose.WithStore(schemaStore{base}),
		goose.WithSessionLocker(locker),
		goose.WithDisableGlobalRegistry(true),
	}, opts...)
	p, err := goose.NewProvider(goose.DialectCustom, db, migrations.FS, all...)
	if err != nil {
		return nil, fmt.Errorf("idem/migrate: %w", err)
	}
	return p, nil
}

// Up applies every pending migration. Re-running it is a no-op.
func Up(ctx context.Context, db *sql.DB) ([]*goose.MigrationResult, error) {
	p, err := NewProvider(db, goose.WithSlog(discardLogger))
	if err != nil {
		return nil, err
	}
	return p.Up(ctx)
}

// schemaStore is goose's Postgres store, but it creates schema idem before
// creating the version table inside it.
type schemaStore struct{ database.Store }

func (s schemaStore) CreateVersionTable(ctx context.Context, db database.DBTxConn) error {
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+Schema); err != nil {
		return fmt.Errorf("create schema %s: %w", Schema, err)
	}
	return s.Store.CreateVersionTable(ctx, db)
}

func (s schemaStore) TableExists(ctx context.Context, db database.DBTxConn) (bool, error) {
	if ext, ok := s.Store.(database.StoreExtender); ok {
		return ext.TableExists(ctx, db)
	}
	return false, errors.ErrUnsupported
}

var discardLogger = slog.New(slog.DiscardHandler)
