package idem_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestWait: a claim with WithWait on a key in progress answers as the
// original ends: Completed with its result, Acquired when it failed and
// released the key, Acquired when its worker died and the lease lapsed (no
// notification: the waiter looks again when the lease ends), InProgress
// past the wait. On a pgx pool and through database/sql (which polls).
func TestWait(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 8)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	for name, c := range map[string]*idem.Client{"pgx": testdb.Client(t, pool, nil), "database/sql": testdb.SQLClient(t, db, nil)} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			key := func(k string) string { return name + "/" + k }
			// in waits in a goroutine for key; its answer arrives on the channel.
			in := func(k string, wait time.Duration) <-chan *idem.Claim {
				ch := make(chan *idem.Claim, 1)
				go func() {
					cl, err := c.Claim(ctx, "w", key(k), idem.WithWait(wait))
					if err != nil {
						t.Error(err)
					}
					ch <- cl
				}()
				return ch
			}
			t.Run("completed", func(t *testing.T) {
				orig, _ := c.Claim(ctx, "w", key("done"))
				ch := in("done", 10*time.Second)
				time.Sleep(300 * time.Millisecond)
				if err := c.Complete(ctx, "w", key("done"), orig.Token, json.RawMessage(`{"n":1}`)); err != nil {
					t.Fatal(err)
				}
				if cl := <-ch; cl.Outcome != idem.Completed || string(cl.Result) != `{"n": 1}` {
					t.Fatalf("%+v", cl)
				}
			})
			t.Run("released", func(t *testing.T) {
				orig, _ := c.Claim(ctx, "w", key("released"))
				ch := in("released", 10*time.Second)
				time.Sleep(300 * time.Millisecond)
				if err := c.Fail(ctx, "w", key("released"), orig.Token, "try again", true); err != nil {
					t.Fatal(err)
				}
				if cl := <-ch; cl.Outcome != idem.Acquired || cl.Attempt != 2 {
					t.Fatalf("%+v", cl)
				}
			})
			t.Run("lease lapses", func(t *testing.T) {
				_, _ = c.Claim(ctx, "w", key("died"), idem.WithLease(time.Second))
				start := time.Now()
				if cl := <-in("died", 10*time.Second); cl.Outcome != idem.Acquired || time.Since(start) < 900*time.Millisecond {
					t.Fatalf("%+v after %v", cl, time.Since(start))
				}
			})
			t.Run("bound", func(t *testing.T) {
				_, _ = c.Claim(ctx, "w", key("slow"))
				start := time.Now()
				cl := <-in("slow", 400*time.Millisecond)
				if d := time.Since(start); cl.Outcome != idem.InProgress || d < 400*time.Millisecond || d > 2*time.Second {
					t.Fatalf("%+v after %v", cl, d)
				}
			})
		})
	}
}

// TestWaitRefused: a wait out of range, or inside a transaction, is
// refused with ErrInvalidInput before anything runs.
func TestWaitRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, c := setup(t)
	for _, d := range []time.Duration{-time.Second, idem.MaxWait + time.Second} {
		if _, err := c.Claim(ctx, "w", "k", idem.WithWait(d)); !errors.Is(err, idem.ErrInvalidInput) {
			t.Errorf("WithWait(%v): %v", d, err)
		}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := c.WithTx(tx).Claim(ctx, "w", "k", idem.WithWait(time.Second))
		return err
	})
	if !errors.Is(err, idem.ErrInvalidInput) {
		t.Errorf("WithWait in a transaction: %v", err)
	}
}

// TestNotifyOnlyWhenWaited: a completion notifies channel idem_done only
// when a waiter registered for its key (NOTIFY serializes commits
// cluster-wide; nobody pays for it unasked), and the payload is the key's
// digest.
func TestNotifyOnlyWhenWaited(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	if _, err := conn.Exec(ctx, `LISTEN idem_done`); err != nil {
		t.Fatal(err)
	}
	next := func() string {
		wctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		defer cancel()
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			return ""
		}
		return n.Payload
	}
	cl, _ := c.Claim(ctx, "n", "unwatched")
	_ = c.Complete(ctx, "n", "unwatched", cl.Token, nil)
	if p := next(); p != "" {
		t.Fatalf("a completion nobody waited for notified %q", p)
	}
	cl, _ = c.Claim(ctx, "n", "watched")
	var id int64
	if err := pool.QueryRow(ctx, `SELECT idem.wait_begin('n', 'watched', '1 minute')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	_ = c.Complete(ctx, "n", "watched", cl.Token, nil)
	var want string
	_ = pool.QueryRow(ctx, `SELECT md5('n' || E'\x1f' || 'watched')`).Scan(&want)
	if p := next(); p != want {
		t.Fatalf("notified %q, want %q", p, want)
	}
	if _, err := pool.Exec(ctx, `SELECT idem.wait_end($1)`, id); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.waiters`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("%d waiters left (%v)", n, err)
	}
}

// TestListenerCloses: a pool client's waiters share one LISTEN connection,
// opened when the first one waits and closed once the last one has left
// (after an idle delay, 10 s: not asserted, a timing); a client with a
// cache keeps it until Close.
func TestListenerCloses(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 8)
	listeners := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = $1`, idem.ListenerApplicationName).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	orig, _ := c.Claim(ctx, "l", "k")
	done := make(chan struct{})
	go func() {
		defer close(done)
		for range 5 { // five waiters at once, one connection
			go func() { _, _ = c.Claim(ctx, "l", "k", idem.WithWait(10*time.Second)) }()
		}
	}()
	<-done
	for deadline := time.Now().Add(5 * time.Second); listeners() != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d listening connections while 5 wait, want 1", listeners())
		}
	}
	if err := c.Complete(ctx, "l", "k", orig.Token, nil); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); listeners() != 0; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the listening connection is still open 30 s after the last waiter left")
		}
	}
	// A cache keeps its listener until Close.
	cc, err := idem.New(pool, &idem.Config{Cache: &idem.CacheConfig{}})
	if err != nil {
		t.Fatal(err)
	}
	_, _ = cc.Claim(ctx, "l", "k")
	for deadline := time.Now().Add(5 * time.Second); listeners() != 1; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no listener for the cache")
		}
	}
	cc.Close()
	for deadline := time.Now().Add(5 * time.Second); listeners() != 0; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the cache's listener is still open after Close")
		}
	}
}

// TestWaitCountedOnce: a duplicate that waits (WithWait) for the original
// to complete is counted as one duplicate, not two (its claim after the
// wait is not counted): on a pgx pool and through database/sql.
func TestWaitCountedOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 8)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	for name, c := range map[string]*idem.Client{"pgx": testdb.Client(t, pool, nil), "sql": testdb.SQLClient(t, db, nil)} {
		source := "once-" + name
		countEvery(t, pool, source)
		orig, err := c.Claim(ctx, source, "k")
		if err != nil {
			t.Fatal(err)
		}
		ch := make(chan *idem.Claim, 1)
		go func() {
			cl, err := c.Claim(ctx, source, "k", idem.WithWait(10*time.Second))
			if err != nil {
				t.Error(err)
			}
			ch <- cl
		}()
		time.Sleep(300 * time.Millisecond)
		if err := c.Complete(ctx, source, "k", orig.Token, json.RawMessage(`1`)); err != nil {
			t.Fatal(err)
		}
		if cl := <-ch; cl == nil || cl.Outcome != idem.Completed {
			t.Fatalf("%s: the waiter got %+v", name, cl)
		}
		if n := counted(t, pool, source); n != 1 {
			t.Errorf("%s: a waiting duplicate counted %d times, want once", name, n)
		}
	}
}

// TestPeekLiveRowOnly: Peek answers "" for a key whose row expired (a claim
// takes it as new), and the row's status while it lives.
func TestPeekLiveRowOnly(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	c := testdb.Client(t, testdb.Pool(t, url, 2), nil)
	cl, err := c.Claim(ctx, "peek", "k", idem.WithTTL(time.Minute), idem.WithLease(30*time.Second))
	if err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("%+v %v", cl, err)
	}
	if err := c.Complete(ctx, "peek", "k", cl.Token, json.RawMessage(`1`)); err != nil {
		t.Fatal(err)
	}
	if st, err := c.Peek(ctx, "peek", "k"); err != nil || st != "completed" {
		t.Fatalf("live: %q %v", st, err)
	}
	later := testdb.Client(t, testdb.PoolAt(t, url, 2, time.Now().Add(2*time.Minute)), nil)
	if st, err := later.Peek(ctx, "peek", "k"); err != nil || st != "" {
		t.Fatalf("expired: %q %v, want \"\"", st, err)
	}
}
