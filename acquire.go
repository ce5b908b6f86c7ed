package idem

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrNoConnection: an effect's claim found no free connection of the pool
// within Config.EffectAcquireWait. An event whose work runs in the
// caller's transaction holds one connection of the pool while each of its
// effects needs another; when every connection is held by such events,
// none of them would ever get one. The effect fails instead (its event's
// work fails, the caller's transaction ends, the delivery is retried), and
// the error says how to size the pool.
var ErrNoConnection = errors.New("idem: no connection of the pool came free")

// DefaultEffectAcquireWait is Config.EffectAcquireWait's default.
const DefaultEffectAcquireWait = 5 * time.Second

// acquireWaitKey carries, in a statement's context, how long its
// connection may take to come free (see boundAcquire).
type acquireWaitKey struct{}

// boundAcquire returns ctx asking the pool drivers to take the connection
// of the statement run under it explicitly, waiting at most wait, and to
// answer ErrNoConnection past it. wait <= 0 leaves ctx as it is: the
// pool's own unbounded wait.
func boundAcquire(ctx context.Context, wait time.Duration) context.Context {
	if wait <= 0 {
		return ctx
	}
	return context.WithValue(ctx, acquireWaitKey{}, wait)
}

// NoConnectionError is ErrNoConnection with the pool's size and the wait.
type NoConnectionError struct {
	Wait     time.Duration
	MaxConns int // 0 when the pool does not say (database/sql without SetMaxOpenConns)
}

func (e *NoConnectionError) Error() string {
	size := "an unbounded pool"
	if e.MaxConns > 0 {
		size = fmt.Sprintf("a pool of %d", e.MaxConns)
	}
	return fmt.Sprintf("%v within %v (%s): every connection may be held by events whose transactions wait for their effects; "+
		"size the pool for two connections per event in flight whose work runs in a transaction (WithTx) and calls Effect, "+
		"or raise Config.EffectAcquireWait", ErrNoConnection, e.Wait, size)
}

func (e *NoConnectionError) Is(target error) bool { return target == ErrNoConnection }

// acquireErr turns a bounded acquisition's timeout into a NoConnectionError;
// ctx's own end, and any other error, are returned as they are.
func acquireErr(ctx context.Context, err error, wait time.Duration, maxConns int) error {
	if ctx.Err() == nil && errors.Is(err, context.DeadlineExceeded) {
		return &NoConnectionError{Wait: wait, MaxConns: maxConns}
	}
	return err
}

// boundedConn takes a connection for one statement under ctx when ctx
// asks for a bounded wait (boundAcquire): acquire, under a deadline of that
// wait, past which the error is a NoConnectionError naming the pool's size.
// ok is false when ctx asks for nothing: run on the pool as usual.
func boundedConn[C any](ctx context.Context, acquire func(context.Context) (C, error), maxConns func() int) (conn C, ok bool, err error) {
	wait, bounded := ctx.Value(acquireWaitKey{}).(time.Duration)
	if !bounded {
		return conn, false, nil
	}
	actx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	conn, err = acquire(actx)
	if err != nil {
		return conn, true, acquireErr(ctx, err, wait, maxConns())
	}
	return conn, true, nil
}

// pgxBounded is boundedConn on a pgx pool (ok false for any other executor).
func pgxBounded(ctx context.Context, db PgxExecutor) (*pgxpool.Conn, bool, error) {
	pool, isPool := db.(*pgxpool.Pool)
	if !isPool {
		return nil, false, nil
	}
	return boundedConn(ctx, pool.Acquire, func() int { return int(pool.Config().MaxConns) })
}

// sqlBounded is boundedConn on a *sql.DB.
func sqlBounded(ctx context.Context, db SQLExecutor) (*sql.Conn, bool, error) {
	pool, isPool := db.(*sql.DB)
	if !isPool {
		return nil, false, nil
	}
	return boundedConn(ctx, pool.Conn, func() int { return pool.Stats().MaxOpenConnections })
}
