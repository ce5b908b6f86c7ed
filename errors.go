package idem

import (
	"github.com/idemkit/idem/internal/sqlstate"
	"unicode/utf8"

	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Sentinel errors. Every error the package returns for one of these causes
// matches it with errors.Is; errors that came from PostgreSQL are *Error
// values that also unwrap to the *pgconn.PgError.
var (
	// ErrInvalidInput: an empty, blank, NULL, oversized, non-UTF-8 or
	// NUL-containing source or key; a bad TTL, lease or lock wait; a result
	// that is not JSON or holds a NUL character (\u0000), a lone UTF-16
	// surrogate escape or a number beyond PostgreSQL's numeric (see
	// CheckResult). SQLSTATEs 22004, 22023, 22001, 22021, 22P02, 22P05, 22003.
	ErrInvalidInput = errors.New("idem: invalid input")
	// ErrResultTooLarge: the stored result would exceed 1 MiB (SQLSTATE 54000).
	ErrResultTooLarge = errors.New("idem: result too large")
	// ErrUnknownPolicy: no row in idem.policies for the source and no
	// default row '*' (SQLSTATE 42704).
	ErrUnknownPolicy = errors.New("idem: no retention policy for source")
	// ErrIsolationNotSupported: idem.claim was called in a REPEATABLE READ
	// transaction (SQLSTATE 0A000). Use READ COMMITTED or SERIALIZABLE.
	ErrIsolationNotSupported = errors.New("idem: isolation level not supported")
	// ErrSerialization: the transaction lost a race (SQLSTATE 40001 or
	// 40P01, or on Citus XX000 "could not commit transaction for shard ...
	// on at least one active node": a worker's part failed at commit, and
	// the transaction was rolled back); retry the whole transaction.
	ErrSerialization = errors.New("idem: serialization failure, retry the transaction")
	// ErrNotMigrated: schema idem or its functions are missing; apply the
	// migrations (idemctl migrate up, or package migrate).
	ErrNotMigrated = errors.New("idem: schema idem is missing or out of date; run the migrations")

	// ErrStaleToken: complete/fail/extend with a token that no longer owns
	// the key (the lease was lost and another worker re-acquired it, or the
	// key was finished). Nothing was changed.
	ErrStaleToken = errors.New("idem: stale token, another worker owns this key")
	// ErrNotFound: complete/fail/extend of a key that has no live row.
	ErrNotFound = errors.New("idem: key not found")

	// ErrInProgress: Do found another worker holding a live lease on the key.
	ErrInProgress = errors.New("idem: key is being processed by another worker")
	// ErrMismatch: Do found the key used before with a different fingerprint.
	ErrMismatch = errors.New("idem: key reused with a different request fingerprint")
	// ErrFailed: Do found a permanent failure recorded for the key; the
	// returned error is a *FailedError carrying its message.
	ErrFailed = errors.New("idem: key failed permanently")
	// ErrLeaseLost: Do's work finished, but its lease had been lost and
	// another worker re-acquired the key; its result was not stored.
	ErrLeaseLost = errors.New("idem: lease lost while the work ran")
	// ErrResultNotStored: Do's work ran and the key is completed, but its
	// result could not be stored (the error also matches the cause:
	// ErrResultTooLarge or ErrInvalidInput). Duplicates are answered as
	// done, with no result.
	ErrResultNotStored = errors.New("idem: the work ran and the key is completed, but its result could not be stored")
	// ErrNotDelegated: on Citus, a claim ran on a node that does not hold
	// its key's shard, where its per-key lock would not exclude the owning
	// node's claims (SQLSTATE ID005, migration 11; docs/citus.md). Nothing
	// was claimed.
	ErrNotDelegated = errors.New("idem: the claim was not delegated to the Citus node that holds its key")
	// ErrBatchTooLarge: a batch of more than MaxBatch items (SQLSTATE ID009
	// from the database). Nothing was claimed or recorded.
	ErrBatchTooLarge = errors.New("idem: batch too large")
	// ErrBatchNotSupported: a batch claim on a distributed (Citus)
	// installation, whose keys live on several nodes (SQLSTATE ID006):
	// claim each key with Claim or Do, which Citus delegates to the key's
	// node. Nothing was claimed.
	ErrBatchNotSupported = errors.New("idem: batch claims are not supported on a distributed installation")
)

// Error is an error from PostgreSQL while running an idem operation.
type Error struct {
	Op     string // "claim", "complete", "fail" or "extend"
	Source string
	Key    string
	Kind   error // one of the sentinels above, or nil when none fits
	Err    error // the underlying error, usually a *pgconn.PgError
}

func (e *Error) Error() string {
	return fmt.Sprintf("idem: %s %q/%q: %v", e.Op, Quote(e.Source), Quote(e.Key), e.Err)
}

// quoteMax is the longest source or key an error message quotes whole.
const quoteMax = 64

// Quote shortens a source or key for an error message or a log line: one
// of up to 64 bytes is returned as it is; a longer one (a bad key can be
// any length) becomes its first 48 bytes, "…" and its length, so an error
// never echoes a whole oversized input back.
func Quote(s string) string {
	if len(s) <= quoteMax {
		return s
	}
	cut := 48
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return fmt.Sprintf("%s…(%d bytes)", s[:cut], len(s))
}

// Unwrap lets errors.Is/As reach both the sentinel and the driver error.
func (e *Error) Unwrap() []error {
	if e.Kind == nil {
		return []error{e.Err}
	}
	return []error{e.Kind, e.Err}
}

// SQLState returns the PostgreSQL error code, or "" when there is none.
func (e *Error) SQLState() string { return sqlstate.Of(e.Err) }

// FailedError is returned by Do for a key whose work failed permanently.
type FailedError struct {
	Message string // the error recorded by idem.fail
}

func (e *FailedError) Error() string { return "idem: key failed permanently: " + e.Message }

// Is reports FailedError as ErrFailed.
func (e *FailedError) Is(target error) bool { return target == ErrFailed }

// PanicError is returned by Do when the work panicked. The key was released
// as a retryable failure.
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string { return fmt.Sprintf("idem: work panicked: %v", e.Value) }

type permanent struct{ err error }

func (p permanent) Error() string { return p.err.Error() }
func (p permanent) Unwrap() error { return p.err }

// Permanent marks an error returned from Do's work as permanent: the key is
// recorded as failed and later deliveries get ErrFailed instead of running
// the work again. Other errors release the key for a retry.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return permanent{err}
}

type momentary struct{ err error }

func (m momentary) Error() string { return m.err.Error() }
func (m momentary) Unwrap() error { return m.err }

// Momentary marks an error returned from Do's work as about the moment,
// not the work (rate limited, a dependency briefly unavailable): the key
// is released for a retry, as for any retryable error, and the attempt
// is not counted toward the source's max_attempts (migration 20; an
// earlier schema counts it). Permanent wins over it.
func Momentary(err error) error {
	if err == nil {
		return nil
	}
	return momentary{err}
}

// IsMomentary reports whether err was marked with Momentary.
func IsMomentary(err error) bool {
	var m momentary
	return errors.As(err, &m)
}

// IsPermanent reports whether err was marked with Permanent.
func IsPermanent(err error) bool {
	var p permanent
	return errors.As(err, &p)
}

// convert turns a driver error into an *Error with its sentinel: the one
// place where this package maps SQLSTATEs (named in internal/sqlstate,
// where the maintenance packages and idemctl read theirs) to sentinels.
func convert(op, source, key string, err error) error {
	if err == nil {
		return nil
	}
	e := &Error{Op: op, Source: source, Key: key, Err: err}
	switch code := sqlstate.Of(err); {
	case code != "":
		switch code {
		case sqlstate.NullValueNotAllowed, sqlstate.InvalidParameterValue, sqlstate.StringDataRightTrunc,
			sqlstate.CharacterNotInRepert, sqlstate.InvalidTextRepr, sqlstate.UntranslatableChar,
			sqlstate.NumericOutOfRange:
			e.Kind = ErrInvalidInput
		case sqlstate.ProgramLimitExceeded:
			e.Kind = ErrResultTooLarge
		case sqlstate.UndefinedObject:
			e.Kind = ErrUnknownPolicy
		case sqlstate.FeatureNotSupported:
			// idem.claim's refusal of REPEATABLE READ; other 0A000s (a
			// cached plan whose result type changed under a migration)
			// are no isolation error.
			if isolationRefused(err) {
				e.Kind = ErrIsolationNotSupported
			}
		case sqlstate.SerializationFailure, sqlstate.DeadlockDetected:
			e.Kind = ErrSerialization
		case sqlstate.InternalError:
			// Citus: a worker's part failed when the transaction was
			// committed (a serialization failure at its commit among
			// them); the whole transaction was rolled back.
			if sqlstate.CitusCommitFailed(err) {
				e.Kind = ErrSerialization
			}
		case sqlstate.InvalidSchemaName, sqlstate.UndefinedFunction, sqlstate.UndefinedTable:
			e.Kind = ErrNotMigrated
		case sqlstate.NotDelegated:
			e.Kind = ErrNotDelegated
		case sqlstate.BatchTooLarge:
			e.Kind = ErrBatchTooLarge
		case sqlstate.Distributed:
			e.Kind = ErrBatchNotSupported
		}
	case errors.Is(err, pgx.ErrNoRows):
		// The protocol functions always return a row; none means the
		// function is not the one this package was built for.
		e.Kind = ErrNotMigrated
	}
	return e
}

// isolationRefused: err is idem.claim's refusal of REPEATABLE READ.
func isolationRefused(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == sqlstate.FeatureNotSupported && strings.Contains(pg.Message, "REPEATABLE READ")
}

// outcomeErr maps the text outcome of complete/fail/extend to an error.
func outcomeErr(op, source, key, outcome string) error {
	switch outcome {
	case "completed", "already_completed", "failed", "extended":
		return nil
	case "stale_token":
		return &Error{Op: op, Source: source, Key: key, Kind: ErrStaleToken, Err: ErrStaleToken}
	case "not_found":
		return &Error{Op: op, Source: source, Key: key, Kind: ErrNotFound, Err: ErrNotFound}
	}
	return &Error{Op: op, Source: source, Key: key, Kind: ErrNotMigrated,
		Err: fmt.Errorf("unexpected outcome %q from idem.%s", outcome, op)}
}

// transient reports an error worth retrying on another attempt (another
// pooled connection): a lost or refused connection, a serialization
// failure or deadlock, resource exhaustion, an administrator's or pooler's
// termination, a lock or statement timeout, a pooler's missing or duplicate
// prepared statement. idem's own answers (invalid input, stale token) and
// context errors are final.
func transient(err error) bool {
	if err == nil || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	for _, final := range []error{ErrInvalidInput, ErrResultTooLarge, ErrUnknownPolicy, ErrNotMigrated,
		ErrIsolationNotSupported, ErrStaleToken, ErrNotFound, ErrInvalidConfig, ErrBatchTooLarge, ErrBatchNotSupported} {
		if errors.Is(err, final) {
			return false
		}
	}
	if code := sqlstate.Of(err); code != "" {
		switch code {
		case sqlstate.InvalidSQLStatement, sqlstate.DuplicatePreparedStmt, sqlstate.LockNotAvailable:
			return true
		case sqlstate.InternalError:
			// Citus' form of a failure at commit (ErrSerialization).
			return sqlstate.CitusCommitFailed(err)
		case sqlstate.FeatureNotSupported:
			// pgx drops a cached statement whose plan's result type
			// changed (a migration under a running client); sent again, it
			// is prepared afresh.
			return strings.Contains(err.Error(), "cached plan must not change result type")
		}
		switch sqlstate.Class(err) {
		case "08", "40", "53", "57", "58":
			return true
		}
		return false
	}
	// Not an answer from the server: the connection failed or was lost.
	return true
}
