// Package maintlock is the client side of idem's maintenance locks
// (idem.try_lock / idem.release_lock): leases in a table, renewed by their
// holder, that end by themselves when the holder dies. Unlike a session
// advisory lock they hold no state on a connection, so they are safe
// through PgBouncer's transaction pooling.
package maintlock

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/idemkit/idem/db/pgxdb"
)

// Holder is the state of a lock after a try.
type Holder struct {
	Acquired  bool
	Holder    string
	ExpiresAt time.Time
}

// Lock is one named maintenance lock held (or wanted) by one holder.
type Lock struct {
	q      *pgxdb.Queries
	name   string
	holder string
	ttl    time.Duration
}

// New returns a lock handle; nothing is taken until Acquire. A ttl of 0
// takes the lock's default lease from the database (idem.lock_ttl).
func New(q *pgxdb.Queries, name, holder string, ttl time.Duration) *Lock {
	return &Lock{q: q, name: name, holder: holder, ttl: ttl}
}

// Acquire takes the lock, or renews it when this holder has it.
func (l *Lock) Acquire(ctx context.Context) (Holder, error) {
	var ttl *int64 // nil: the lock's default lease, idem.lock_ttl(name)
	if l.ttl > 0 {
		ttl = new(l.ttl.Milliseconds())
	}
	row, err := l.q.TryLock(ctx, pgxdb.TryLockParams{Name: l.name, Holder: l.holder, TtlMs: ttl})
	if err != nil {
		return Holder{}, fmt.Errorf("take the %s lock: %w", l.name, err)
	}
	return Holder{Acquired: row.Acquired, Holder: row.Holder, ExpiresAt: row.ExpiresAt.Time}, nil
}

// Take is Acquire for the start of a run: a lock held by someone else is
// logged (debug) with its holder, and the caller skips its run.
func (l *Lock) Take(ctx context.Context, log *slog.Logger) (Holder, error) {
	held, err := l.Acquire(ctx)
	if err == nil && !held.Acquired {
		log.LogAttrs(ctx, slog.LevelDebug, l.name+" skipped: another instance holds the lock",
			slog.String("holder", held.Holder), slog.Time("until", held.ExpiresAt))
	}
	return held, err
}

// Release gives the lock up. It runs even when ctx is cancelled (SIGTERM):
// a lock left behind would make the next run wait for its lease to end.
func (l *Lock) Release(ctx context.Context, log *slog.Logger) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := l.q.ReleaseLock(rctx, pgxdb.ReleaseLockParams{Name: l.name, Holder: l.holder}); err != nil {
		log.LogAttrs(ctx, slog.LevelWarn, "could not release the lock; it ends with its lease",
			slog.String("lock", l.name), slog.Any("error", err))
	}
}

// NewHolderID names this process in the lock table: host, pid and a
// random suffix (pids repeat across containers).
func NewHolderID() string {
	host, _ := os.Hostname()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("idemctl@%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b))
}
