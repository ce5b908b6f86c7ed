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

// pgxBounded takes a connection of pool for one statement under ctx when
// ctx asks for a bounded wait; release returns it. ok is false when there
// is nothing to do (not a pool, or no bound asked): run on the pool.
func pgxBounded(ctx context.Context, db PgxExecutor) (conn *pgxpool.Conn, ok bool, err error) {
	pool, isPool := db.(*pgxpool.Pool)
	wait, bounded := ctx.Value(acquireWaitKey{}).(time.Duration)
	if !isPool || !bounded {
		return nil, false, nil
	}
	actx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	conn, err = pool.Acquire(actx)
	if err != nil {
		return nil, true, acquireErr(ctx, err, wait, int(pool.Config().MaxConns))
	}
	return conn, true, nil
}

// sqlBounded is pgxBounded for database/sql.
func sqlBounded(ctx context.Context, db SQLExecutor) (conn *sql.Conn, ok bool, err error) {
	pool, isPool := db.(*sql.DB)
	wait, bounded := ctx.Value(acquireWaitKey{}).(time.Duration)
	if !isPool || !bounded {
		return nil, false, nil
	}
	actx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	conn, err = pool.Conn(actx)
	if err != nil {
		return nil, true, acquireErr(ctx, err, wait, pool.Stats().MaxOpenConnections)
	}
	return conn, true, nil
}
