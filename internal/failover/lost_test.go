package failover

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/maintlock"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

// TestFailoverLostWrites makes the asynchronous window certain instead of
// likely: the replica stops receiving the primary's WAL, the primary
// acknowledges writes the replica never gets, then it is lost and the
// replica promoted. What the promotion forgot, and what it did not:
//   - an event completed before the cut is replayed, its work not run;
//   - an event completed after the cut (acknowledged to its sender) runs
//     again on the new primary, but its effect's outbound key is the same,
//     so the downstream charges once;
//   - a worker that claimed a key after the cut completes it against the
//     new primary: refused (ErrNotFound), and again (ErrStaleToken) once
//     another worker has taken the key, whose token differs from the
//     forgotten one;
//   - a worker whose claim reached the replica keeps its lease and
//     completes against the new primary;
//   - an inbox event accepted (answered) after the cut is gone: its sender
//     will not deliver it again; one accepted before is queued;
//   - a maintenance lock taken before the cut is still its holder's: the
//     holder renews it, another takes it once its lease ends, and the old
//     holder's late release does not take it back.
func TestFailoverLostWrites(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := &servers{}
	var err error
	if s.primary, err = pgcluster.Start(ctx, pgcluster.Setting("synchronous_commit", "on")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stop)
	if s.standby, err = s.primary.Standby(ctx); err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", s.url())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('pay', '1 day', '1 minute'), ('pay/effects', '1 day', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	db.Close()
	pool, err := pgxpool.New(ctx, s.url()+" pool_max_conns=8")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(pool, &idem.Config{Logger: slog.New(slog.DiscardHandler), RecordTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	in, err := inbox.New(inbox.Config{Pool: pool, Idem: c, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	accept := func(key string) (inbox.Acceptance, error) {
		return in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: key, Payload: []byte(`{}`)})
	}

	down := &downstream{byKey: map[string]string{}, charges: map[string]int{}}
	api := httptest.NewServer(down)
	t.Cleanup(api.Close)
	tr, err := idemhttp.NewTransport(http.DefaultTransport, nil)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: tr}
	runs := map[string]int{}
	work := func(key string) func(context.Context) (any, error) {
		return func(ctx context.Context) (any, error) {
			runs[key]++
			return idem.EffectValue(ctx, c, "charge", func(ctx context.Context) (string, error) {
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api.URL+"/v1/charges", strings.NewReader(key))
				resp, err := hc.Do(req)
				if err != nil {
					return "", err
				}
				defer resp.Body.Close()
				b, _ := io.ReadAll(resp.Body)
				return string(b), nil
			})
		}
	}

	// Before the cut, replicated: a completed event, a worker's claim, a
	// maintenance lock.
	if _, err := c.Do(ctx, "pay", "before", work("before")); err != nil {
		t.Fatal(err)
	}
	held, err := c.Claim(ctx, "pay", "held")
	if err != nil || held.Outcome != idem.Acquired {
		t.Fatalf("claim held: %+v %v", held, err)
	}
	if _, err := accept("order-before"); err != nil {
		t.Fatal(err)
	}
	q := pgxdb.New(pool)
	runner := maintlock.New(q, "prune", "runner-on-the-old-primary", 4*time.Second)
	if h, err := runner.Acquire(ctx); err != nil || !h.Acquired {
		t.Fatalf("lock: %+v %v", h, err)
	}
	waitReplayed(t, s)
	cutStream(t, s.standby)

	// After the cut, acknowledged by the primary only.
	if _, err := c.Do(ctx, "pay", "after", work("after")); err != nil {
		t.Fatal(err)
	}
	late, err := c.Claim(ctx, "pay", "late")
	if err != nil || late.Outcome != idem.Acquired {
		t.Fatalf("claim late: %+v %v", late, err)
	}
	if a, err := accept("order-after"); err != nil || a.Duplicate {
		t.Fatalf("accept order-after: %+v %v", a, err)
	}

	s.primary.Crash()
	if err := s.standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}

	// The first statement on each pooled connection that the lost primary
	// served fails (the connection is gone): an error the sender retries,
	// not an answer.
	do := func(key string) (*idem.Result, error) {
		for i := 0; ; i++ {
			res, err := c.Do(ctx, "pay", key, work(key))
			if err == nil || i == 10 || !pgconn.SafeToRetry(err) && !isConnLost(err) {
				return res, err
			}
		}
	}
	t.Run("completed before the cut: replayed", func(t *testing.T) {
		res, err := do("before")
		if err != nil || !res.Replayed || runs["before"] != 1 {
			t.Fatalf("%+v %v, ran %d times", res, err, runs["before"])
		}
	})
	t.Run("completed after the cut: runs again, charged once", func(t *testing.T) {
		res, err := do("after")
		if err != nil || res.Replayed || runs["after"] != 2 {
			t.Fatalf("%+v %v, ran %d times", res, err, runs["after"])
		}
		down.mu.Lock()
		defer down.mu.Unlock()
		if down.charges["after"] != 1 {
			t.Fatalf("the downstream charged %d times", down.charges["after"])
		}
	})
	t.Run("a claim the promotion forgot: its completion refused, its token not handed out again", func(t *testing.T) {
		if err := c.Complete(ctx, "pay", "late", late.Token, nil); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("complete with the forgotten token: %v, want ErrNotFound", err)
		}
		again, err := c.Claim(ctx, "pay", "late")
		if err != nil || again.Outcome != idem.Acquired || again.Token == late.Token {
			t.Fatalf("claim on the new primary: %+v %v (forgotten token %d)", again, err, late.Token)
		}
		if err := c.Complete(ctx, "pay", "late", late.Token, nil); !errors.Is(err, idem.ErrStaleToken) {
			t.Fatalf("complete with the forgotten token: %v, want ErrStaleToken", err)
		}
		if err := c.Complete(ctx, "pay", "late", again.Token, []byte(`1`)); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("an inbox event accepted after the cut is lost; one before it is queued", func(t *testing.T) {
		// The sender of order-after got its 2xx and will not deliver it
		// again: the event is gone, and a delivery of it would be new.
		var before, after int
		if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE key = 'order-before'), count(*) FILTER (WHERE key = 'order-after')
			FROM idem.holds WHERE source = 'shop'`).Scan(&before, &after); err != nil {
			t.Fatal(err)
		}
		if before != 1 || after != 0 {
			t.Fatalf("holds on the new primary: order-before %d, order-after %d", before, after)
		}
		if a, err := accept("order-before"); err != nil || !a.Duplicate {
			t.Fatalf("order-before delivered again: %+v %v", a, err)
		}
	})
	t.Run("a replicated claim keeps its lease", func(t *testing.T) {
		if err := c.Complete(ctx, "pay", "held", held.Token, []byte(`1`)); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("a maintenance lock ends with its lease", func(t *testing.T) {
		other := maintlock.New(q, "prune", "runner-on-the-new-primary", 4*time.Second)
		h, err := other.Acquire(ctx)
		if err != nil || h.Acquired || h.Holder != "runner-on-the-old-primary" {
			t.Fatalf("another runner took the lock at once: %+v %v", h, err)
		}
		if h, err := runner.Acquire(ctx); err != nil || !h.Acquired {
			t.Fatalf("its holder could not renew it: %+v %v", h, err)
		}
		// The holder is gone (as if it had run against the lost primary
		// only): the lock is the other's once its lease ends, unreleased.
		for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
			h, err := other.Acquire(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if h.Acquired {
				break
			}
			if h.Holder != "runner-on-the-old-primary" || time.Now().After(deadline) {
				t.Fatalf("the lock after its holder stopped renewing: %+v", h)
			}
		}
		runner.Release(ctx, slog.New(slog.DiscardHandler)) // not its holder's any more: changes nothing
		if h, err := other.Acquire(ctx); err != nil || !h.Acquired {
			t.Fatalf("the old holder's release took the lock from the new one: %+v %v", h, err)
		}
	})
}

// waitReplayed waits until the standby has replayed everything the
// primary wrote so far.
func waitReplayed(t *testing.T, s *servers) {
	t.Helper()
	ctx := context.Background()
	var lsn string
	if err := queryRow(ctx, s.primary, `SELECT pg_current_wal_lsn()::text`, &lsn); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var caught bool
		if err := queryRow(ctx, s.standby, fmt.Sprintf(`SELECT pg_last_wal_replay_lsn() >= '%s'::pg_lsn`, lsn), &caught); err != nil {
			t.Fatal(err)
		}
		if caught {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the standby did not replay up to %s within 30 s", lsn)
		}
	}
}

// cutStream stops the standby's WAL receiver (no primary_conninfo): from
// now on it gets nothing the primary writes.
func cutStream(t *testing.T, standby *pgcluster.Cluster) {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, standby.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET primary_conninfo = ''`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SELECT pg_reload_conf()`); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var receiving bool
		if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_wal_receiver)`).Scan(&receiving); err != nil {
			t.Fatal(err)
		}
		if !receiving {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the standby's WAL receiver did not stop within 30 s")
		}
	}
}

func queryRow(ctx context.Context, c *pgcluster.Cluster, sql string, dest any) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	return conn.QueryRow(ctx, sql).Scan(dest)
}

// isConnLost: err is the loss of the connection (the server went away),
// not an answer of the server's.
func isConnLost(err error) bool {
	var pgErr *pgconn.PgError
	return !errors.As(err, &pgErr) && (errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) || strings.Contains(err.Error(), "connection"))
}
