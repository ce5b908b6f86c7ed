package idem

import (
	"github.com/idemkit/idem/internal/sqlstate"

	"context"
	"database/sql"
	"encoding/json"
	"log/slog"
	"reflect"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/db/sqldb"
)

// PgxExecutor is what New needs: *pgxpool.Pool, *pgx.Conn and pgx.Tx all
// satisfy it.
type PgxExecutor interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// SQLExecutor is what NewSQL needs: *sql.DB, *sql.Conn and *sql.Tx all
// satisfy it (with the pgx stdlib driver, lib/pq or any PostgreSQL driver).
type SQLExecutor interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	PrepareContext(ctx context.Context, query string) (*sql.Stmt, error)
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// claimArgs are the arguments of idem.claim after option processing.
type claimArgs struct {
	source, key, fingerprint, eventType string
	ttl, lease                          time.Duration
	lockWait                            *time.Duration // nil: the database's default
	wait                                time.Duration  // WithWait: 0, no waiting
	acquireWait                         time.Duration  // an effect's claim: bound on the pool's wait (boundAcquire)
}

// driver is the thin seam between the public API and the two generated
// query packages; each method is one protocol call.
type driver interface {
	claim(ctx context.Context, a claimArgs) (*Claim, error)
	// claimUncounted is claim, in a transaction of its own that tells
	// idem.count_duplicate not to count (idem.uncounted): a waiting
	// duplicate's claim after its wait, already counted by its first.
	claimUncounted(ctx context.Context, a claimArgs) (*Claim, error)
	// complete completes the key; with echo (and a result) it also returns
	// the result as stored, in jsonb's text form.
	complete(ctx context.Context, source, key string, token int64, result []byte, echo bool) (outcome string, stored []byte, err error)
	completeUnstored(ctx context.Context, source, key string, token int64, reason string) (string, error)
	fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (string, error)
	failMomentary(ctx context.Context, source, key string, token int64, msg string) (string, error)
	extend(ctx context.Context, source, key string, token int64, lease time.Duration) (string, time.Time, error)
	// claimBatch, completeBatch and failBatch are the batch calls
	// (driver_batch.go): one answer per item, in the items' order, or nil
	// when the function answered some item twice or not at all.
	claimBatch(ctx context.Context, a batchArgs) ([]*Claim, error)
	// claimBatchCitus is claimBatch on a distributed (Citus) installation
	// (driver_citus.go); distributed says whether idem is one.
	claimBatchCitus(ctx context.Context, a batchArgs) ([]*Claim, error)
	distributed(ctx context.Context) (bool, error)
	completeBatch(ctx context.Context, source string, items []Completion) (outcomes, stored []string, err error)
	failBatch(ctx context.Context, source string, items []Failure) ([]string, error)
	// peek reads the key's status and remaining lease (status "" when
	// there is no row); waitBegin and waitEnd register a waiter.
	peek(ctx context.Context, source, key string) (string, time.Duration, error)
	waitBegin(ctx context.Context, source, key string, wait time.Duration) (int64, error)
	waitEnd(ctx context.Context, id int64) error
	// missingFunctions returns those of the functions listed (';'
	// separated signatures) that do not exist, '; ' separated.
	missingFunctions(ctx context.Context, functions string) (string, error)
	// cacheable reports whether what the executor's transaction reads is
	// only what other transactions committed, each statement with a
	// snapshot of its own (Config.Cache inside the caller's transaction).
	cacheable(ctx context.Context) (bool, error)
	// concurrent reports whether the executor may be used from several
	// goroutines at once (a pool), which Do's heartbeat needs.
	concurrent() bool
	// guard runs fn, under a savepoint when the executor is the caller's
	// transaction and risky is set: a statement the server may refuse (a
	// result over its size limit) then leaves the transaction usable.
	guard(ctx context.Context, risky bool, fn func() error) error
}

// savepoint runs fn under a savepoint of the transaction exec runs in; a
// failed fn is rolled back to it, so the transaction goes on. exec sends a
// statement without arguments (both drivers send those with the simple
// protocol: no prepared statement, which a transaction pooler keeps).
func savepoint(ctx context.Context, exec func(ctx context.Context, sql string) error, fn func() error) error {
	if err := exec(ctx, "SAVEPOINT idem_guard"); err != nil {
		return err
	}
	if err := fn(); err != nil {
		if exec(ctx, "ROLLBACK TO SAVEPOINT idem_guard") == nil {
			_ = exec(ctx, "RELEASE SAVEPOINT idem_guard")
		}
		return err
	}
	return exec(ctx, "RELEASE SAVEPOINT idem_guard")
}

func msPtr(d time.Duration) *int64 {
	if d == 0 {
		return nil
	}
	ms := d.Milliseconds() // below a millisecond becomes 0, which SQL rejects
	return &ms
}

// waitMs is lock_wait in milliseconds: nil for the database's default,
// and a real zero (answer at once) kept apart from it.
func waitMs(d *time.Duration) *int64 {
	if d == nil {
		return nil
	}
	ms := max(d.Milliseconds(), 0)
	return &ms
}

func strPtr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

type pgxDriver struct {
	q    *pgxdb.Queries
	db   PgxExecutor
	mode *execMode
}

func newPgxDriver(db PgxExecutor, mode *execMode) pgxDriver {
	return pgxDriver{q: pgxdb.New(modeExecutor{db: db, mode: mode}), db: db, mode: mode}
}

// uncounted is the statement that marks a transaction's claims as not to
// be counted as duplicates (idem.count_duplicate). The mark is the
// transaction's start time: a value another client left in the session
// marks nothing.
const uncounted = `SELECT pg_catalog.set_config('idem.uncounted', pg_catalog.now()::pg_catalog.text, true)`

// execMode is the pgx query execution mode of a Client's protocol
// statements, shared by the clients WithTx derives from it. Zero (adaptive)
// uses the pool's own mode until the server answers that a prepared
// statement is missing or already exists (SQLSTATE 26000, 42P05: a
// transaction pooler such as PgBouncer before 1.21 handed the connection
// another backend); from then on the client uses QueryExecModeExec, which
// needs no named prepared statement.
type execMode struct {
	fixed    pgx.QueryExecMode // set by Config.QueryExecMode; 0 adapts
	switched atomic.Bool
	log      *slog.Logger
}

func (m *execMode) args(args []any) []any {
	mode := m.fixed
	if mode == 0 {
		if !m.switched.Load() {
			return args
		}
		mode = pgx.QueryExecModeExec
	}
	return append(append(make([]any, 0, len(args)+1), mode), args...)
}

// adapt reports whether err is a pooler's prepared-statement error on an
// adaptive client, and switches it to exec mode. Such a statement failed
// before it ran, so it can be sent again.
func (m *execMode) adapt(err error) bool {
	code := sqlstate.Of(err)
	if m.fixed != 0 || (code != sqlstate.InvalidSQLStatement && code != sqlstate.DuplicatePreparedStmt) {
		return false
	}
	if m.switched.CompareAndSwap(false, true) {
		m.log.LogAttrs(context.Background(), slog.LevelWarn,
			"idem: the server refused a prepared statement (a transaction pooler such as PgBouncer?); this client now uses pgx's exec mode",
			slog.String("sqlstate", code))
	}
	return true
}

// modeExecutor runs statements in the client's execution mode and, outside
// a transaction, sends a statement again once when the pooler refused it.
type modeExecutor struct {
	db   PgxExecutor
	mode *execMode
}

func (e modeExecutor) retry(err error) bool {
	if !e.mode.adapt(err) {
		return false
	}
	_, inTx := e.db.(pgx.Tx) // the transaction is aborted: the caller retries it
	return !inTx
}

func (e modeExecutor) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	tag, err := e.db.Exec(ctx, sql, e.mode.args(args)...)
	if err != nil && e.retry(err) {
		return e.db.Exec(ctx, sql, e.mode.args(args)...)
	}
	return tag, err
}

func (e modeExecutor) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return e.db.Query(ctx, sql, e.mode.args(args)...) // the batch calls retry a refused statement (pgxRetry)
}

func (e modeExecutor) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return modeRow{e: e, ctx: ctx, sql: sql, args: args}
}

// modeRow runs its query when scanned, so that a refused statement can be
// sent again.
type modeRow struct {
	e    modeExecutor
	ctx  context.Context
	sql  string
	args []any
}

func (r modeRow) Scan(dest ...any) error {
	err := r.e.db.QueryRow(r.ctx, r.sql, r.e.mode.args(r.args)...).Scan(dest...)
	if err != nil && r.e.retry(err) {
		err = r.e.db.QueryRow(r.ctx, r.sql, r.e.mode.args(r.args)...).Scan(dest...)
	}
	return err
}

func (d pgxDriver) concurrent() bool {
	_, ok := d.db.(*pgxpool.Pool)
	return ok
}

func (d pgxDriver) guard(ctx context.Context, risky bool, fn func() error) error {
	if _, inTx := d.db.(pgx.Tx); !risky || !inTx {
		return fn()
	}
	return savepoint(ctx, func(ctx context.Context, sql string) error {
		_, err := d.db.Exec(ctx, sql)
		return err
	}, fn)
}

// usTime is a protocol timestamp, microseconds since the Unix epoch as the
// queries send it (sql/queries/protocol.sql: a timestamptz in text is
// written in the session's DateStyle, which any client of a pooled
// connection can change); 0 is none.
func usTime(us int64) time.Time {
	if us == 0 {
		return time.Time{}
	}
	return time.UnixMicro(us)
}

func (d pgxDriver) claim(ctx context.Context, a claimArgs) (*Claim, error) {
	if conn, ok, err := pgxBounded(ctx, d.db); ok {
		if err != nil {
			return nil, err
		}
		defer conn.Release()
		d = newPgxDriver(conn, d.mode)
	}
	row, err := d.q.Claim(ctx, pgxdb.ClaimParams{
		Source: a.source, Key: a.key,
		Fingerprint: strPtr(a.fingerprint), EventType: strPtr(a.eventType),
		TtlMs: msPtr(a.ttl), LeaseMs: msPtr(a.lease), LockWaitMs: waitMs(a.lockWait),
	})
	if err != nil {
		return nil, err
	}
	return &Claim{
		Outcome: Outcome(row.Outcome), Source: a.source, Key: a.key,
		Token: row.Token, Attempt: int(row.Attempt),
		LeaseExpiresAt: usTime(row.LeaseExpiresAtUs), Result: json.RawMessage(row.Result),
		Error: row.Error, FirstSeen: usTime(row.FirstSeenUs), ExpiresAt: usTime(row.ExpiresAtUs),
		LeaseRemaining: time.Duration(row.LeaseRemainingMs) * time.Millisecond,
	}, nil
}

func (d pgxDriver) claimUncounted(ctx context.Context, a claimArgs) (*Claim, error) {
	b, ok := d.db.(interface {
		Begin(ctx context.Context) (pgx.Tx, error)
	})
	if !ok {
		return d.claim(ctx, a)
	}
	var cl *Claim
	run := func(tx pgx.Tx) (err error) {
		if _, err = (modeExecutor{db: tx, mode: d.mode}).Exec(ctx, uncounted); err != nil {
			return err
		}
		cl, err = newPgxDriver(tx, d.mode).claim(ctx, a)
		return err
	}
	err := pgx.BeginFunc(ctx, b, run)
	if err != nil && d.mode.adapt(err) {
		// A pooler refused a prepared statement: the transaction is gone,
		// and the client now runs in exec mode; once more.
		err = pgx.BeginFunc(ctx, b, run)
	}
	return cl, err
}

func (d pgxDriver) complete(ctx context.Context, source, key string, token int64, result []byte, echo bool) (string, []byte, error) {
	// The result travels as text: a []byte parameter is bytea to PostgreSQL
	// when pgx does not describe the statement first (exec and simple
	// protocol modes, which PgBouncer setups use).
	if result == nil || !echo {
		var text *string
		if result != nil {
			s := string(result)
			text = &s
		}
		out, err := d.q.Complete(ctx, pgxdb.CompleteParams{Source: source, Key: key, Token: token, Result: text})
		return out, nil, err
	}
	row, err := d.q.CompleteStored(ctx, pgxdb.CompleteStoredParams{Source: source, Key: key, Token: token, Result: string(result)})
	return row.Outcome, []byte(row.Stored), err
}

func (d pgxDriver) completeUnstored(ctx context.Context, source, key string, token int64, reason string) (string, error) {
	return d.q.CompleteUnstored(ctx, pgxdb.CompleteUnstoredParams{Source: source, Key: key, Token: token, Reason: reason})
}

func (d pgxDriver) fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (string, error) {
	return d.q.Fail(ctx, pgxdb.FailParams{Source: source, Key: key, Token: token, Error: &msg, Retryable: retryable})
}

func (d pgxDriver) failMomentary(ctx context.Context, source, key string, token int64, msg string) (string, error) {
	return d.q.FailMomentary(ctx, pgxdb.FailMomentaryParams{Source: source, Key: key, Token: token, Error: &msg})
}

func (d pgxDriver) extend(ctx context.Context, source, key string, token int64, lease time.Duration) (string, time.Time, error) {
	row, err := d.q.Extend(ctx, pgxdb.ExtendParams{Source: source, Key: key, Token: token, LeaseMs: msPtr(lease)})
	return row.Outcome, usTime(row.LeaseExpiresAtUs), err
}

func (d pgxDriver) peek(ctx context.Context, source, key string) (string, time.Duration, error) {
	row, err := d.q.Peek(ctx, pgxdb.PeekParams{Source: source, Key: key})
	return row.Status, time.Duration(row.LeaseRemainingMs) * time.Millisecond, err
}

func (d pgxDriver) cacheable(ctx context.Context) (bool, error) { return d.q.Cacheable(ctx) }

func (d pgxDriver) waitBegin(ctx context.Context, source, key string, wait time.Duration) (int64, error) {
	return d.q.WaitBegin(ctx, pgxdb.WaitBeginParams{Source: source, Key: key, WaitMs: max(wait.Milliseconds(), 1)})
}

func (d pgxDriver) waitEnd(ctx context.Context, id int64) error { return d.q.WaitEnd(ctx, id) }

type sqlDriver struct {
	q    *sqldb.Queries
	db   SQLExecutor
	mode *execMode // nil unless the driver is pgx's stdlib (sqlExecMode)
}

func newSQLDriver(db SQLExecutor, mode *execMode) sqlDriver {
	return sqlDriver{q: sqldb.New(sqlModeExecutor{db: db, mode: mode}), db: db, mode: mode}
}

// sqlExecMode returns the execution mode of a database/sql client whose
// driver is pgx's stdlib, which takes a pgx.QueryExecMode as a leading
// argument as pgx itself does (its default, the statement cache, names
// prepared statements, which a transaction pooler such as PgBouncer before
// 1.21 does not keep). nil for any other driver (lib/pq's default, unnamed
// statements, needs no switch), and for a *sql.Tx given to NewSQL, whose
// driver cannot be asked.
func sqlExecMode(db SQLExecutor, fixed pgx.QueryExecMode, log *slog.Logger) *execMode {
	var drv any
	switch x := db.(type) {
	case *sql.DB:
		drv = x.Driver()
	case *sql.Conn:
		_ = x.Raw(func(c any) error { drv = c; return nil })
	}
	if drv == nil {
		return nil
	}
	t := reflect.TypeOf(drv)
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.PkgPath() != "github.com/jackc/pgx/v5/stdlib" {
		return nil
	}
	return &execMode{fixed: fixed, log: log}
}

// sqlModeExecutor runs statements in the client's execution mode (pgx's
// stdlib only).
type sqlModeExecutor struct {
	db   SQLExecutor
	mode *execMode
}

func (e sqlModeExecutor) args(args []any) []any {
	if e.mode == nil {
		return args
	}
	return e.mode.args(args)
}

func (e sqlModeExecutor) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	return e.db.ExecContext(ctx, query, e.args(args)...)
}

func (e sqlModeExecutor) PrepareContext(ctx context.Context, query string) (*sql.Stmt, error) {
	return e.db.PrepareContext(ctx, query)
}

func (e sqlModeExecutor) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	return e.db.QueryContext(ctx, query, e.args(args)...)
}

func (e sqlModeExecutor) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	return e.db.QueryRowContext(ctx, query, e.args(args)...)
}

// sqlRetry runs one protocol call and, when the pooler refused its prepared
// statement (which switches the client to exec mode), sends it once more,
// outside a transaction (inside one, the transaction is aborted: the
// caller retries it).
func sqlRetry[T any](d sqlDriver, call func() (T, error)) (T, error) {
	v, err := call()
	if err != nil && d.mode != nil && d.mode.adapt(err) {
		if _, inTx := d.db.(*sql.Tx); !inTx {
			return call()
		}
	}
	return v, err
}

func (d sqlDriver) concurrent() bool {
	_, ok := d.db.(*sql.DB)
	return ok
}

func (d sqlDriver) guard(ctx context.Context, risky bool, fn func() error) error {
	if _, inTx := d.db.(*sql.Tx); !risky || !inTx {
		return fn()
	}
	return savepoint(ctx, func(ctx context.Context, sql string) error {
		_, err := d.db.ExecContext(ctx, sql)
		return err
	}, fn)
}

func nullStr(s string) sql.NullString { return sql.NullString{String: s, Valid: s != ""} }

func nullMs(d time.Duration) sql.NullInt64 { return nullInt(msPtr(d)) }

func nullInt(p *int64) sql.NullInt64 {
	if p != nil {
		return sql.NullInt64{Int64: *p, Valid: true}
	}
	return sql.NullInt64{}
}

func (d sqlDriver) claim(ctx context.Context, a claimArgs) (*Claim, error) {
	if conn, ok, err := sqlBounded(ctx, d.db); ok {
		if err != nil {
			return nil, err
		}
		defer conn.Close()
		d = newSQLDriver(conn, d.mode)
	}
	row, err := sqlRetry(d, func() (sqldb.ClaimRow, error) {
		return d.q.Claim(ctx, sqldb.ClaimParams{
			Source: a.source, Key: a.key,
			Fingerprint: nullStr(a.fingerprint), EventType: nullStr(a.eventType),
			TtlMs: nullMs(a.ttl), LeaseMs: nullMs(a.lease), LockWaitMs: nullInt(waitMs(a.lockWait)),
		})
	})
	if err != nil {
		return nil, err
	}
	c := &Claim{
		Outcome: Outcome(row.Outcome), Source: a.source, Key: a.key,
		Token: row.Token, Attempt: int(row.Attempt),
		LeaseExpiresAt: usTime(row.LeaseExpiresAtUs), Error: row.Error,
		FirstSeen: usTime(row.FirstSeenUs), ExpiresAt: usTime(row.ExpiresAtUs),
		LeaseRemaining: time.Duration(row.LeaseRemainingMs) * time.Millisecond,
	}
	if row.Result.Valid {
		c.Result = row.Result.RawMessage
	}
	return c, nil
}

func (d sqlDriver) claimUncounted(ctx context.Context, a claimArgs) (cl *Claim, err error) {
	db, ok := d.db.(*sql.DB)
	if !ok {
		return d.claim(ctx, a)
	}
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	if _, err = tx.ExecContext(ctx, uncounted); err != nil {
		return nil, err
	}
	if cl, err = (sqlDriver{q: sqldb.New(tx), db: tx}).claim(ctx, a); err != nil {
		return nil, err
	}
	return cl, tx.Commit()
}

func (d sqlDriver) complete(ctx context.Context, source, key string, token int64, result []byte, echo bool) (string, []byte, error) {
	if result == nil || !echo {
		out, err := sqlRetry(d, func() (string, error) {
			return d.q.Complete(ctx, sqldb.CompleteParams{Source: source, Key: key, Token: token,
				Result: sql.NullString{String: string(result), Valid: result != nil}})
		})
		return out, nil, err
	}
	row, err := sqlRetry(d, func() (sqldb.CompleteStoredRow, error) {
		return d.q.CompleteStored(ctx, sqldb.CompleteStoredParams{Source: source, Key: key, Token: token, Result: string(result)})
	})
	return row.Outcome, []byte(row.Stored), err
}

func (d sqlDriver) completeUnstored(ctx context.Context, source, key string, token int64, reason string) (string, error) {
	return sqlRetry(d, func() (string, error) {
		return d.q.CompleteUnstored(ctx, sqldb.CompleteUnstoredParams{Source: source, Key: key, Token: token, Reason: reason})
	})
}

func (d sqlDriver) fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (string, error) {
	return sqlRetry(d, func() (string, error) {
		return d.q.Fail(ctx, sqldb.FailParams{Source: source, Key: key, Token: token,
			Error: sql.NullString{String: msg, Valid: true}, Retryable: retryable})
	})
}

func (d sqlDriver) failMomentary(ctx context.Context, source, key string, token int64, msg string) (string, error) {
	return sqlRetry(d, func() (string, error) {
		return d.q.FailMomentary(ctx, sqldb.FailMomentaryParams{Source: source, Key: key, Token: token,
			Error: sql.NullString{String: msg, Valid: true}})
	})
}

func (d sqlDriver) extend(ctx context.Context, source, key string, token int64, lease time.Duration) (string, time.Time, error) {
	row, err := sqlRetry(d, func() (sqldb.ExtendRow, error) {
		return d.q.Extend(ctx, sqldb.ExtendParams{Source: source, Key: key, Token: token, LeaseMs: nullMs(lease)})
	})
	return row.Outcome, usTime(row.LeaseExpiresAtUs), err
}

func (d sqlDriver) peek(ctx context.Context, source, key string) (string, time.Duration, error) {
	row, err := sqlRetry(d, func() (sqldb.PeekRow, error) {
		return d.q.Peek(ctx, sqldb.PeekParams{Source: source, Key: key})
	})
	return row.Status, time.Duration(row.LeaseRemainingMs) * time.Millisecond, err
}

func (d sqlDriver) waitBegin(ctx context.Context, source, key string, wait time.Duration) (int64, error) {
	return sqlRetry(d, func() (int64, error) {
		return d.q.WaitBegin(ctx, sqldb.WaitBeginParams{Source: source, Key: key, WaitMs: max(wait.Milliseconds(), 1)})
	})
}

func (d sqlDriver) cacheable(context.Context) (bool, error) { return false, nil } // no cache on database/sql

func (d sqlDriver) waitEnd(ctx context.Context, id int64) error {
	_, err := sqlRetry(d, func() (struct{}, error) { return struct{}{}, d.q.WaitEnd(ctx, id) })
	return err
}
