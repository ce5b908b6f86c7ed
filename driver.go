package idem

import (
	"context"
	"database/sql"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
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
}

// driver is the thin seam between the public API and the two generated
// query packages; each method is one protocol call.
type driver interface {
	claim(ctx context.Context, a claimArgs) (*Claim, error)
	complete(ctx context.Context, source, key string, token int64, result []byte) (string, error)
	completeUnstored(ctx context.Context, source, key string, token int64, reason string) (string, error)
	fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (string, error)
	extend(ctx context.Context, source, key string, token int64, lease time.Duration) (string, time.Time, error)
	// concurrent reports whether the executor may be used from several
	// goroutines at once (a pool), which Do's heartbeat needs.
	concurrent() bool
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
	q  *pgxdb.Queries
	db PgxExecutor
}

func newPgxDriver(db PgxExecutor, mode pgx.QueryExecMode) pgxDriver {
	return pgxDriver{q: pgxdb.New(execMode{db: db, mode: mode}), db: db}
}

// execMode runs every protocol statement in one pgx query execution mode,
// whatever the pool's default: QueryExecModeExec by default, which needs no
// named prepared statement on the server, so idem works through PgBouncer
// in transaction mode with pgx's default configuration (whose statement
// cache would otherwise fail on another backend's missing statement).
type execMode struct {
	db   PgxExecutor
	mode pgx.QueryExecMode
}

func (e execMode) args(args []any) []any {
	return append(append(make([]any, 0, len(args)+1), e.mode), args...)
}

func (e execMode) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return e.db.Exec(ctx, sql, e.args(args)...)
}

func (e execMode) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return e.db.Query(ctx, sql, e.args(args)...)
}

func (e execMode) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return e.db.QueryRow(ctx, sql, e.args(args)...)
}

func (d pgxDriver) concurrent() bool {
	_, ok := d.db.(*pgxpool.Pool)
	return ok
}

func tsOf(t pgtype.Timestamptz) time.Time {
	if !t.Valid {
		return time.Time{}
	}
	return t.Time
}

func (d pgxDriver) claim(ctx context.Context, a claimArgs) (*Claim, error) {
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
		LeaseExpiresAt: tsOf(row.LeaseExpiresAt), Result: json.RawMessage(row.Result),
		Error: row.Error, FirstSeen: tsOf(row.FirstSeen), ExpiresAt: tsOf(row.ExpiresAt),
		LeaseRemaining: time.Duration(row.LeaseRemainingMs) * time.Millisecond,
	}, nil
}

func (d pgxDriver) complete(ctx context.Context, source, key string, token int64, result []byte) (string, error) {
	// The result travels as text: a []byte parameter is bytea to PostgreSQL
	// when pgx does not describe the statement first (exec and simple
	// protocol modes, which PgBouncer setups use).
	var text *string
	if result != nil {
		s := string(result)
		text = &s
	}
	return d.q.Complete(ctx, pgxdb.CompleteParams{Source: source, Key: key, Token: token, Result: text})
}

func (d pgxDriver) completeUnstored(ctx context.Context, source, key string, token int64, reason string) (string, error) {
	return d.q.CompleteUnstored(ctx, pgxdb.CompleteUnstoredParams{Source: source, Key: key, Token: token, Reason: reason})
}

func (d pgxDriver) fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (string, error) {
	return d.q.Fail(ctx, pgxdb.FailParams{Source: source, Key: key, Token: token, Error: &msg, Retryable: retryable})
}

func (d pgxDriver) extend(ctx context.Context, source, key string, token int64, lease time.Duration) (string, time.Time, error) {
	row, err := d.q.Extend(ctx, pgxdb.ExtendParams{Source: source, Key: key, Token: token, LeaseMs: msPtr(lease)})
	return row.Outcome, tsOf(row.LeaseExpiresAt), err
}

type sqlDriver struct {
	q  *sqldb.Queries
	db SQLExecutor
}

func (d sqlDriver) concurrent() bool {
	_, ok := d.db.(*sql.DB)
	return ok
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
	row, err := d.q.Claim(ctx, sqldb.ClaimParams{
		Source: a.source, Key: a.key,
		Fingerprint: nullStr(a.fingerprint), EventType: nullStr(a.eventType),
		TtlMs: nullMs(a.ttl), LeaseMs: nullMs(a.lease), LockWaitMs: nullInt(waitMs(a.lockWait)),
	})
	if err != nil {
		return nil, err
	}
	c := &Claim{
		Outcome: Outcome(row.Outcome), Source: a.source, Key: a.key,
		Token: row.Token, Attempt: int(row.Attempt),
		LeaseExpiresAt: row.LeaseExpiresAt.Time, Error: row.Error,
		FirstSeen: row.FirstSeen.Time, ExpiresAt: row.ExpiresAt.Time,
		LeaseRemaining: time.Duration(row.LeaseRemainingMs) * time.Millisecond,
	}
	if row.Result.Valid {
		c.Result = row.Result.RawMessage
	}
	return c, nil
}

func (d sqlDriver) complete(ctx context.Context, source, key string, token int64, result []byte) (string, error) {
	return d.q.Complete(ctx, sqldb.CompleteParams{Source: source, Key: key, Token: token,
		Result: sql.NullString{String: string(result), Valid: result != nil}})
}

func (d sqlDriver) completeUnstored(ctx context.Context, source, key string, token int64, reason string) (string, error) {
	return d.q.CompleteUnstored(ctx, sqldb.CompleteUnstoredParams{Source: source, Key: key, Token: token, Reason: reason})
}

func (d sqlDriver) fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (string, error) {
	return d.q.Fail(ctx, sqldb.FailParams{Source: source, Key: key, Token: token,
		Error: sql.NullString{String: msg, Valid: true}, Retryable: retryable})
}

func (d sqlDriver) extend(ctx context.Context, source, key string, token int64, lease time.Duration) (string, time.Time, error) {
	row, err := d.q.Extend(ctx, sqldb.ExtendParams{Source: source, Key: key, Token: token, LeaseMs: nullMs(lease)})
	return row.Outcome, row.LeaseExpiresAt.Time, err
}
