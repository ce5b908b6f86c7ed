package idem

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"time"
)

// MaxWait is the longest WithWait accepted.
const MaxWait = time.Hour

// WithWait makes a claim that finds its key in progress (another worker
// runs it) wait up to d for that worker to finish, instead of answering
// InProgress at once: when the original completes, the claim answers
// Completed with its result (Do replays it, without running the work);
// when it fails or its lease lapses, the claim acquires the key (Do runs
// the work); past d, it answers InProgress as without the option. 0 (the
// default) does not wait; at most MaxWait.
//
// Waiting needs a pool-backed client (New over a *pgxpool.Pool, or NewSQL
// over a *sql.DB): inside a transaction a claim cannot wait for another
// (ErrInvalidInput). A pgx pool's client is woken by PostgreSQL's
// LISTEN/NOTIFY on one connection of its own, shared by all its waiters
// and opened only while some wait (the original's completion notifies only
// when someone waits: migration 8). Where notifications cannot arrive, it
// polls the key's status with backoff (10 ms doubling to 250 ms): behind a
// transaction pooler such as PgBouncer in transaction mode (LISTEN needs a
// session of its own; the client finds out by notifying itself when it
// starts listening) and on database/sql clients. A waiting duplicate polls
// with idem.peek, read-only, and claims again in a transaction that is not
// counted (migration 15), so it is counted as a duplicate once (on Citus,
// where the claim runs on a worker, the claim after the wait is counted
// too).
func WithWait(d time.Duration) ClaimOption { return func(a *claimArgs) { a.wait = d } }

// waitKey is the notification payload of a key (idem.wait_channel_key).
func waitKey(source, key string) string {
	sum := md5.Sum([]byte(source + "\x1f" + key))
	return hex.EncodeToString(sum[:])
}

// checkWait validates WithWait's duration for a claim on this client.
func (c *Client) checkWait(a *claimArgs) error {
	switch {
	case a.wait < 0 || a.wait > MaxWait:
		return &Error{Op: "claim", Source: a.source, Key: a.key, Kind: ErrInvalidInput,
			Err: fmt.Errorf("WithWait %v must be between 0 and %v", a.wait, MaxWait)}
	case a.wait > 0 && !c.d.concurrent():
		return &Error{Op: "claim", Source: a.source, Key: a.key, Kind: ErrInvalidInput,
			Err: errorString("WithWait needs a pool-backed client: a claim inside a transaction cannot wait for another worker (it could hold what that worker needs)")}
	}
	return nil
}

// waitFor waits, after cl answered InProgress, until the key is no longer
// in progress (then claims again and returns that answer) or a.wait has
// passed (then returns cl). The caller's cancellation is an error.
func (c *Client) waitFor(ctx context.Context, a claimArgs, cl *Claim) (*Claim, error) {
	wctx, cancel := context.WithTimeout(ctx, a.wait)
	defer cancel()
	var notified <-chan struct{}
	if c.hub != nil {
		w := c.hub.subscribe(waitKey(a.source, a.key))
		defer c.hub.unsubscribe(w)
		notified = w.ch
		if c.hub.mayListen() {
			// Registered, the original's completion notifies; an error
			// here leaves polling, which needs no registration.
			if id, err := c.d.waitBegin(wctx, a.source, a.key, a.wait); err == nil {
				defer func() {
					ectx, ecancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
					defer ecancel()
					_ = c.d.waitEnd(ectx, id)
				}()
			}
		}
	}
	pause, lease := 10*time.Millisecond, cl.LeaseRemaining
	for {
		// Look first: the original may have finished before we registered.
		status, left, err := c.d.peek(wctx, a.source, a.key)
		if err == nil && (status != "processing" || left <= 0) {
			// Counted as a duplicate once, by the claim that found the
			// key in progress: this one is not counted again. It runs to
			// its end even if the wait's deadline passes meanwhile (it is
			// bounded by its lock wait): cut short, it could commit an
			// acquisition that no one would know it holds, and the key
			// would run nothing until its lease ended.
			next, err := c.d.claimUncounted(ctx, a)
			if err != nil {
				return nil, convert("claim", a.source, a.key, err)
			}
			if next.Outcome != InProgress {
				return next, nil
			}
			cl, lease = next, next.LeaseRemaining // held (the inbox), or taken over meanwhile
		} else if err == nil {
			lease = left
		}
		maxPause := 250 * time.Millisecond
		if c.hub != nil && c.hub.listening() {
			maxPause = time.Second // notified; polling only covers a lease that lapses
		}
		sleep := pause
		if lease > 0 && lease < sleep {
			sleep = lease + time.Millisecond // look again the moment the lease lapses
		}
		pause = min(pause*2, maxPause)
		t := time.NewTimer(sleep)
		select {
		case <-notified:
		case <-t.C:
		case <-wctx.Done():
			t.Stop()
			if err := ctx.Err(); err != nil {
				return nil, convert("claim", a.source, a.key, err)
			}
			return cl, nil
		}
		t.Stop()
	}
}

// Peek reports the status of (source, key) without claiming it or
// counting a duplicate: "processing", "completed", "failed", or "" when
// the key has no live row. It reads what is committed (idem.peek).
func (c *Client) Peek(ctx context.Context, source, key string) (string, error) {
	if err := c.check("peek", source, key); err != nil {
		return "", err
	}
	status, _, err := c.d.peek(ctx, source, key)
	if err != nil {
		return "", convert("peek", source, key, err)
	}
	return status, nil
}
