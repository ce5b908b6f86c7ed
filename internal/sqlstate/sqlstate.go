// Package sqlstate names the SQLSTATEs idem's Go code acts on. Every
// package that turns a server error into one of its own (the idem package's
// sentinels, prune's ErrLockLost, rotation's retries, idemctl's exit codes,
// the pooler detection) reads the code with Of and compares it with a
// constant from here, so each code has one name and one meaning.
//
// idem's own conditions use class ID, which PostgreSQL never raises; the
// others are PostgreSQL's, raised by the server or by idem's functions with
// their standard meaning.
package sqlstate

import (
	"errors"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// idem's own conditions (class ID).
const (
	// LockNotHeld: the caller does not hold the maintenance lock it named
	// (idem.prune_batch). Before migration 6 idem raised 55P03 for this.
	LockNotHeld = "ID001"
	// NotAPartition: the table named is not a (detached) month of
	// idem.processed_events (idem.retire_partition, idem.drop_detached).
	NotAPartition = "ID002"
	// KeyBusy: idem.release refused a key in progress under a live lease,
	// or held by the inbox (migration 8).
	KeyBusy = "ID004"
	// NotDelegated: on Citus, idem.claim ran on a node that does not hold
	// its key's shard (migration 11).
	NotDelegated = "ID005"
	// Distributed: refused on a distributed (Citus) installation
	// (idem.release, migration 13; idem.claim_batch, migration 18).
	Distributed = "ID006"
	// NotIdemsPartition: a table has a month's partition name but idem did
	// not make it (idem.make_month, migration 14).
	NotIdemsPartition = "ID007"
	// RoleConflict: a grant would give one role both the application's and
	// the maintainer's rights (idem.grant_app, idem.grant_maintainer,
	// migration 14).
	RoleConflict = "ID008"
	// BatchTooLarge: a batch of more keys than idem's batch calls take
	// (idem.claim_batch, idem.complete_batch, idem.fail_batch; migration 18).
	BatchTooLarge = "ID009"
	// TooManyDefaultRows: a month has more rows in the default partition
	// than idem.move_default_month was allowed to move (migration 25).
	TooManyDefaultRows = "ID010"
)

// PostgreSQL's conditions that idem's functions also raise, with the
// standard meaning.
const (
	NullValueNotAllowed   = "22004" // a required argument is NULL
	InvalidParameterValue = "22023" // an argument out of range
	StringDataRightTrunc  = "22001" // an argument too long
	CharacterNotInRepert  = "22021" // invalid UTF-8
	InvalidTextRepr       = "22P02"
	UntranslatableChar    = "22P05"
	NumericOutOfRange     = "22003" // a JSON number beyond numeric's range
	ProgramLimitExceeded  = "54000" // a result too large to store
	UndefinedObject       = "42704" // no policy for the source
	FeatureNotSupported   = "0A000" // REPEATABLE READ
	SerializationFailure  = "40001"
	DeadlockDetected      = "40P01"
)

// InternalError is PostgreSQL's XX000, which Citus raises for a worker's
// failure found when it commits a distributed transaction
// (CitusCommitFailed).
const InternalError = "XX000"

// CitusCommitFailed reports whether err is Citus' report that a worker's
// part of a transaction failed when Citus committed it: SQLSTATE XX000,
// "could not commit transaction for shard <id> on at least one active
// node" (Citus 13, ErrorIfPostCommitFailedShardPlacements), raised on the
// coordinator before it commits, so the whole transaction is rolled back
// (in two phases: every worker's prepared part too). The worker's own
// error (40001 for a serialization failure found at its commit) reaches
// the client only as a warning before it. Like 40001 it means: run the
// transaction again.
func CitusCommitFailed(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == InternalError &&
		strings.HasPrefix(pg.Message, "could not commit transaction for shard ") &&
		strings.HasSuffix(pg.Message, " on at least one active node")
}

// PostgreSQL's conditions raised by the server, not by idem.
const (
	LockNotAvailable      = "55P03" // lock_timeout, NOWAIT
	InvalidSchemaName     = "3F000"
	UndefinedFunction     = "42883"
	UndefinedTable        = "42P01"
	UndefinedColumn       = "42703"
	InvalidSQLStatement   = "26000" // prepared statement does not exist (a transaction pooler)
	DuplicatePreparedStmt = "42P05" // prepared statement already exists (a transaction pooler)
	InvalidPassword       = "28P01"
	InvalidAuthorization  = "28000"
	InvalidCatalogName    = "3D000" // database does not exist
	InsufficientPrivilege = "42501"
	UniqueViolation       = "23505" // a concurrent migrator inserted the same version
	DuplicateTable        = "42P07" // a concurrent migrator created the same table
)

// Of returns err's SQLSTATE, or "" when err is not an error from the
// server.
func Of(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

// Message returns the server's message for err, or err's text when err is
// not an error from the server.
func Message(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Message
	}
	if err == nil {
		return ""
	}
	return err.Error()
}

// Class returns the two-letter class of err's SQLSTATE, or "".
func Class(err error) string {
	if c := Of(err); len(c) == 5 {
		return c[:2]
	}
	return ""
}

// idem's migrator's own condition.
const (
	// MigrationStepDone: a migration step found, once it held the
	// migration lock, that another migrator had applied (or rolled back)
	// its version; the migrator looks again (package migrate).
	MigrationStepDone = "IDM01"
	// MigrationLocked: a migration step waited migrate.LockWait for the
	// migration lock, which any session may hold (package migrate).
	MigrationLocked = "IDM02"
)
