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
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

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
	// until is the lease's end as last taken or renewed (the database's
	// clock): how long Release keeps trying when the database is away.
	until time.Time
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
	// Not cancelled with ctx (SIGTERM): on cancellation pgx stops reading
	// the answer and sends the server a cancel request from a goroutine of
	// its own, which lands too late when the try has already committed (or
	// never, when the process exits first); the lock is then taken by a
	// holder that never learns it and never releases it, and every run is
	// skipped for the whole lease (the year bench section met it: a
	// SIGTERMed prune's lock held past the next scheduled runs). The try
	// is short (idem.try_lock waits at most 2 s for the row); the caller
	// sees ctx cancelled right after it and releases what it took.
	row, err := l.q.TryLock(context.WithoutCancel(ctx), pgxdb.TryLockParams{Name: l.name, Holder: l.holder, TtlMs: ttl})
	if err != nil {
		return Holder{}, fmt.Errorf("take the %s lock: %w", l.name, err)
	}
	if row.Acquired {
		l.until = row.ExpiresAt.Time
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
//
// When the database cannot be reached (it restarted, or is restarting,
// under the run: the step in flight failed with the connection), Release
// keeps trying, with backoff, until the database answers or the lease has
// ended by itself, so that the lock is free as soon as the database is
// back rather than for the rest of its lease (10 minutes for rotate).
// With ctx cancelled (SIGTERM, which may come while the database is down,
// or bring the run here because the database went down) it keeps trying
// for releaseGrace more: a database back from a restart within that time
// gets the lock released. Before, the retries stopped after one try once
// ctx was cancelled, and a run SIGTERMed during a restart left its lock
// held for the whole lease (cli.TestSIGTERMWhileDatabaseDown).
func (l *Lock) Release(ctx context.Context, log *slog.Logger) {
	wait := releaseBackoff
	var graceEnd time.Time // set when ctx is first seen cancelled
	for try := 0; ; try++ {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_, err := l.q.ReleaseLock(rctx, pgxdb.ReleaseLockParams{Name: l.name, Holder: l.holder})
		cancel()
		if err == nil {
			if try > 0 {
				log.LogAttrs(ctx, slog.LevelInfo, "released the lock once the database answered again",
					slog.String("lock", l.name), slog.Int("tries", try+1))
			}
			return
		}
		giveUp := l.until
		if ctx.Err() != nil {
			if graceEnd.IsZero() {
				graceEnd = time.Now().Add(releaseGrace)
			}
			if graceEnd.Before(giveUp) {
				giveUp = graceEnd
			}
		}
		if !Unreachable(err) || !time.Now().Add(wait).Before(giveUp) {
			log.LogAttrs(ctx, slog.LevelWarn, "could not release the lock; it ends with its lease",
				slog.String("lock", l.name), slog.Time("until", l.until), slog.Any("error", err))
			return
		}
		if try == 0 {
			log.LogAttrs(ctx, slog.LevelWarn, "the database is unreachable; retrying to release the lock until it answers (or the lease ends)",
				slog.String("lock", l.name), slog.Time("until", l.until), slog.Any("error", err))
		}
		// Not cut short by ctx: once cancelled, ctx is done for good, and
		// the grace above bounds the tries.
		time.Sleep(wait)
		wait = min(2*wait, releaseMaxBackoff)
	}
}

// Release's pause between tries while the database is unreachable, and
// how long it goes on trying after ctx is cancelled (SIGTERM): long enough
// for a database restart, well within the 30 s that idemctl run's
// --shutdown-timeout and Kubernetes' terminationGracePeriodSeconds give a
// stopping process by default (a try itself may take up to 5 s more).
const (
	releaseBackoff    = 100 * time.Millisecond
	releaseMaxBackoff = 2 * time.Second
	releaseGrace      = 15 * time.Second
)

// Unreachable says whether err means the database did not answer the
// statement at all (it is down, restarting, or dropped the connection),
// rather than answering it with an error: the former is worth trying
// again on a new connection, the latter is not.
func Unreachable(err error) bool {
	if err == nil {
		return false
	}
	var pg *pgconn.PgError
	if !errors.As(err, &pg) {
		return !errors.Is(err, context.Canceled)
	}
	// Class 08: connection exception; 57P01-57P03: the server is shutting
	// down, crashed, or not yet accepting connections.
	return strings.HasPrefix(pg.Code, "08") || pg.Code == "57P01" || pg.Code == "57P02" || pg.Code == "57P03"
}

// NewHolderID names this process in the lock table: host, pid and a
// random suffix (pids repeat across containers).
func NewHolderID() string {
	host, _ := os.Hostname()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("idemctl@%s:%d:%s", host, os.Getpid(), hex.EncodeToString(b))
}
