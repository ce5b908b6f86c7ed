package inbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The accept's statements through a transaction pooler.
//
// pgx's default pool configuration (QueryExecModeCacheStatement) names a
// prepared statement per SQL text on each connection and keeps it for the
// connection's life. Behind PgBouncer in transaction mode (before 1.21, or
// without max_prepared_statements) the next transaction of that
// connection may run on another server session, where the statement is
// missing (SQLSTATE 26000) or another client's of the same name exists
// (42P05): the accept's transaction is aborted and the sender is answered
// 503. idem's own client switches to exec mode after the first refusal,
// but that first accept is lost already, and River's insert does not
// switch at all.
//
// So every statement the inbox runs in an accept's (or a replay's, or a
// repair's) transaction, idem's and River's, goes through pooled, which
// sends it in pgx's QueryExecModeCacheDescribe when the connection's mode
// is the default QueryExecModeCacheStatement: an unnamed statement, whose
// description (parameter and result types) is cached, so it still runs
// in one round trip once described and never depends on a statement left
// on a server session. A statement that carries its own mode (idem's
// client once it switched to exec mode) keeps it, and so does a
// connection configured with another mode.

// pooledTx is a pgx.Tx whose statements run in mode unless they name one.
type pooledTx struct {
	pgx.Tx
	mode pgx.QueryExecMode
}

// pooled wraps tx as the comment above says; tx unchanged when its
// connection does not use QueryExecModeCacheStatement (or it has none: a
// pgx.Tx of the caller's own making).
func pooled(tx pgx.Tx) pgx.Tx {
	if p, ok := tx.(pooledTx); ok {
		return p
	}
	if c := tx.Conn(); c == nil || c.Config().DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		return tx
	}
	return pooledTx{Tx: tx, mode: pgx.QueryExecModeCacheDescribe}
}

func (t pooledTx) args(args []any) []any {
	if len(args) > 0 {
		if _, ok := args[0].(pgx.QueryExecMode); ok {
			return args
		}
	}
	return append([]any{t.mode}, args...)
}

func (t pooledTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.Tx.Exec(ctx, sql, t.args(args)...)
}

func (t pooledTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.Tx.Query(ctx, sql, t.args(args)...)
}

func (t pooledTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.Tx.QueryRow(ctx, sql, t.args(args)...)
}

// Begin starts a savepoint whose statements run the same way.
func (t pooledTx) Begin(ctx context.Context) (pgx.Tx, error) {
	sp, err := t.Tx.Begin(ctx)
	if err != nil {
		return nil, err
	}
	return pooledTx{Tx: sp, mode: t.mode}, nil
}
