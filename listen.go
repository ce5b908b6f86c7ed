package idem

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The channels idem notifies (migration 8): a key left 'processing' (for
// waiters), a key was released by an operator (for caches).
const (
	waitChannel    = "idem_done"
	releaseChannel = "idem_released"
)

// ListenerApplicationName is the application_name of a client's listening
// connection (WithWait, Config.Cache), as pg_stat_activity shows it.
const ListenerApplicationName = "idem listener"

// Listener timings.
const (
	listenIdle    = 10 * time.Second // the connection closes this long after the last waiter left
	listenProbe   = 5 * time.Second  // how long the self-test waits for its own notification (2 s timed out on a loaded server)
	listenBackoff = time.Minute      // after a failed start, poll only for this long
)

// hub multiplexes one LISTEN connection for all of a pool client's
// waiters: it connects when the first waiter comes, checks that its own
// notification arrives (behind a transaction pooler it does not), wakes
// the waiters of each key notified, and closes once no one has waited for
// listenIdle.
type hub struct {
	pool  *pgxpool.Pool
	log   *slog.Logger
	cache *cache // Config.Cache: the listener then runs for the client's life

	mu      sync.Mutex
	subs    map[string]map[*hubWaiter]struct{}
	n       int
	running bool      // a listener goroutine exists
	live    bool      // it listens and passed its self-test
	noUntil time.Time // after a failed start: do not try again before
	stop    context.CancelFunc
	idle    *time.Timer
	heard   time.Time // the listener's last notification or ping
	closed  bool      // Client.Close
}

type hubWaiter struct {
	key string
	ch  chan struct{}
}

func newHub(pool *pgxpool.Pool, log *slog.Logger, c *cache) *hub {
	return &hub{pool: pool, log: log, cache: c, subs: map[string]map[*hubWaiter]struct{}{}}
}

// startLocked starts the listener unless it runs, is backing off, or the
// client is closed. h.mu is held.
func (h *hub) startLocked() {
	if h.running || h.closed || !time.Now().After(h.noUntil) {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.running, h.stop = true, cancel
	go h.run(ctx)
}

// fresh: the cache may answer: the listener runs, passed its self-test,
// and was heard from within cacheFresh. Starts it when it does not run.
func (h *hub) fresh() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.startLocked()
	return h.live && time.Since(h.heard) < cacheFresh
}

// close stops the listener for good.
func (h *hub) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	if h.stop != nil {
		h.stop()
	}
}

// subscribe registers a waiter for key, starting the listener if needed.
func (h *hub) subscribe(key string) *hubWaiter {
	w := &hubWaiter{key: key, ch: make(chan struct{}, 1)}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.subs[key] == nil {
		h.subs[key] = map[*hubWaiter]struct{}{}
	}
	h.subs[key][w] = struct{}{}
	h.n++
	if h.idle != nil {
		h.idle.Stop()
		h.idle = nil
	}
	h.startLocked()
	return w
}

func (h *hub) unsubscribe(w *hubWaiter) {
	h.mu.Lock()
	defer h.mu.Unlock()
	delete(h.subs[w.key], w)
	if len(h.subs[w.key]) == 0 {
		delete(h.subs, w.key)
	}
	h.n--
	if h.n == 0 && h.running && h.idle == nil && h.cache == nil {
		stop := h.stop
		h.idle = time.AfterFunc(listenIdle, func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.n == 0 && h.idle != nil {
				h.idle = nil
				stop()
			}
		})
	}
}

// mayListen: notifications may arrive (listening, or starting up).
func (h *hub) mayListen() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.running
}

// listening: the listener passed its self-test and runs.
func (h *hub) listening() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.live
}

// wake wakes the waiters of key ("" wakes every waiter).
func (h *hub) wake(key string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for k, ws := range h.subs {
		if key != "" && k != key {
			continue
		}
		for w := range ws {
			select {
			case w.ch <- struct{}{}:
			default:
			}
		}
	}
}

// run listens until ctx ends or the connection fails; then the waiters
// poll (and the next subscriber, past noUntil, starts a listener again).
func (h *hub) run(ctx context.Context) {
	err := h.listen(ctx)
	h.mu.Lock()
	h.running, h.live = false, false
	if err != nil && ctx.Err() == nil {
		// A pooler will not change its mind soon; a lost connection (a
		// restart, a failover) is tried again at once by the next waiter.
		h.noUntil = time.Now().Add(time.Second)
		if errors.Is(err, errNoSelfNotify) {
			h.noUntil = time.Now().Add(listenBackoff)
		}
	}
	until := h.noUntil
	h.mu.Unlock()
	if h.cache != nil {
		h.cache.drop("") // releases may go unheard from now on
	}
	h.wake("") // they look again, and poll from now on
	if err != nil && ctx.Err() == nil {
		msg := "idem: waiting duplicates poll instead of listening"
		if h.cache != nil {
			msg += "; the cache of completed outcomes does not answer until the listener is back"
		}
		h.log.LogAttrs(context.Background(), slog.LevelInfo, msg, slog.Time("until", until), slog.Any("reason", err))
	}
}

var errNoSelfNotify = errors.New("LISTEN receives no notifications on this connection (a transaction pooler such as PgBouncer in transaction mode?)")

func (h *hub) listen(ctx context.Context) error {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	cfg := h.pool.Config().ConnConfig.Copy()
	cfg.RuntimeParams["application_name"] = ListenerApplicationName
	conn, err := pgx.ConnectConfig(cctx, cfg)
	cancel()
	if err != nil {
		return err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	if _, err := conn.Exec(ctx, "LISTEN "+waitChannel+"; LISTEN "+releaseChannel); err != nil {
		return err
	}
	// Self-test: our own notification, sent from the pool, must arrive.
	b := make([]byte, 8)
	_, _ = rand.Read(b)
	probe := "probe:" + hex.EncodeToString(b)
	if _, err := h.pool.Exec(ctx, `SELECT pg_catalog.pg_notify($1, $2)`, waitChannel, probe); err != nil {
		return err
	}
	deadline := time.Now().Add(listenProbe)
	for {
		pctx, cancel := context.WithDeadline(ctx, deadline)
		n, err := conn.WaitForNotification(pctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if errors.Is(err, context.DeadlineExceeded) {
				return errNoSelfNotify
			}
			return err
		}
		if n.Payload == probe {
			break
		}
		h.notified(n)
	}
	h.mu.Lock()
	h.live, h.heard = true, time.Now()
	h.mu.Unlock()
	for {
		wctx, cancel := ctx, context.CancelFunc(func() {})
		if h.cache != nil {
			// A cache must know its listener is alive: ping when quiet.
			wctx, cancel = context.WithTimeout(ctx, cachePing)
		}
		n, err := conn.WaitForNotification(wctx)
		cancel()
		switch {
		case err == nil:
			h.notified(n)
		case ctx.Err() != nil:
			return nil
		case h.cache != nil && errors.Is(err, context.DeadlineExceeded):
			pctx, cancel := context.WithTimeout(ctx, cachePing)
			_, err = conn.Exec(pctx, "SELECT 1")
			cancel()
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return err
			}
			h.mu.Lock()
			h.heard = time.Now()
			h.mu.Unlock()
		default:
			return err
		}
	}
}

// notified handles one notification: a released key leaves the cache; the
// waiters of the key look again.
func (h *hub) notified(n *pgconn.Notification) {
	if n.Channel == releaseChannel && h.cache != nil {
		h.cache.drop(n.Payload)
	}
	h.mu.Lock()
	h.heard = time.Now()
	h.mu.Unlock()
	h.wake(n.Payload)
}
