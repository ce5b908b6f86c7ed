package reliability

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestCrashMidWork: a worker process acquires keys and is killed with
// SIGKILL; its connections drop. After the lease each key is re-acquired
// exactly once and nothing stays in processing.
func TestCrashMidWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	keys := scale(200, 5000)
	// The dead worker's lease outlasts the test whatever the machine's
	// speed; the redeliveries come from sessions whose clock (idem's test
	// clock) is past every key's lease, as a sender's retry after the
	// lease would be. Nothing here waits on the wall clock.
	lease := time.Hour
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 24)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=crash", "HELPER_URL="+url, fmt.Sprintf("HELPER_KEYS=%d", keys), "HELPER_LEASE="+lease.String())
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "acquired") {
		_ = cmd.Process.Kill()
		t.Fatalf("worker: %q %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	if n := count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'crash' AND status = 'processing'`); n != keys {
		t.Fatalf("%d keys in processing after the crash, want %d", n, keys)
	}

	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Within the lease the dead worker still owns every key, the first
	// acquired as much as the last.
	for _, k := range []int{0, keys / 2, keys - 1} {
		if cl, err := c.Claim(ctx, "crash", fmt.Sprintf("job-%05d", k)); err != nil || cl.Outcome != idem.InProgress {
			t.Fatalf("job-%05d right after the crash: %+v %v", k, cl, err)
		}
	}
	var lapsed time.Time
	if err := pool.QueryRow(ctx, `SELECT max(lease_expires_at) + interval '1 second' FROM idem.processed_events WHERE source = 'crash'`).Scan(&lapsed); err != nil {
		t.Fatal(err)
	}
	c, err = idem.New(testdb.PoolAt(t, url, 24, lapsed), nil)
	if err != nil {
		t.Fatal(err)
	}

	// 8 deliveries of every key race; one acquires each.
	var acquired sync.Map
	var wg sync.WaitGroup
	for k := range keys {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("job-%05d", k)
				cl, err := c.Claim(ctx, "crash", key)
				if err != nil {
					t.Error(err)
					return
				}
				if cl.Outcome == idem.Acquired {
					if _, dup := acquired.LoadOrStore(key, cl); dup {
						t.Errorf("%s re-acquired twice", key)
					}
					if cl.Attempt != 2 {
						t.Errorf("%s: attempt %d, want 2", key, cl.Attempt)
					}
				}
			}()
		}
	}
	wg.Wait()
	n := 0
	acquired.Range(func(k, v any) bool {
		n++
		cl := v.(*idem.Claim)
		if err := c.Complete(ctx, "crash", cl.Key, cl.Token, []byte(`{"done":true}`)); err != nil {
			t.Error(err)
		}
		return true
	})
	if n != keys {
		t.Fatalf("%d keys re-acquired, want %d", n, keys)
	}
	if left := count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE status = 'processing'`); left != 0 {
		t.Fatalf("%d keys still processing", left)
	}
}

// TestConnectionLossInsideAppTransaction: claim, business write and
// complete in one transaction; the connection is terminated before commit.
// The key is claimable again, the write did not happen, a retry does it once.
func TestConnectionLossInsideAppTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	if _, err := pool.Exec(ctx, `CREATE TABLE ledger (event_id text PRIMARY KEY, amount int)`); err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	handle := func(kill bool) error {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return err
		}
		defer conn.Release()
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		_, err = c.WithTx(tx).Do(ctx, "stripe", "evt_9", func(ctx context.Context) (any, error) {
			_, err := tx.Exec(ctx, `INSERT INTO ledger VALUES ('evt_9', 100)`)
			return "booked", err
		})
		if err != nil {
			return err
		}
		if kill {
			pid := conn.Conn().PgConn().PID()
			if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
				return err
			}
		}
		return tx.Commit(ctx)
	}
	if err := handle(true); err == nil {
		t.Fatal("commit on a terminated connection succeeded")
	}
	if n := count(t, pool, `SELECT count(*) FROM ledger`); n != 0 {
		t.Fatalf("the business write survived the lost connection: %d rows", n)
	}
	cl, err := c.Claim(ctx, "stripe", "evt_9")
	if err != nil || cl.Outcome != idem.Acquired || cl.Attempt != 1 {
		t.Fatalf("key after the lost connection: %+v %v, want claimable as new", cl, err)
	}
	_ = c.Fail(ctx, "stripe", "evt_9", cl.Token, "probe", true)
	for range 3 { // the retry, and two more duplicates
		if err := handle(false); err != nil {
			t.Fatal(err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM ledger`); n != 1 {
		t.Fatalf("%d ledger rows after the retries, want 1", n)
	}
}

// TestServerRestart: PostgreSQL is stopped (fast shutdown) and started
// during a claim load. Clients get errors they can retry; afterwards no
// committed key is lost or duplicated. The test runs its own cluster.
func TestServerRestart(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cl, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatalf("this test restarts a server of its own and needs the PostgreSQL server binaries: %v (%s)", err, pgcluster.InstallHint)
	}
	defer cl.Stop()
	pool := mustPool(cl.URL("postgres"))
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	db.Close()
	if _, err := pool.Exec(ctx, `CREATE TABLE effects (key text PRIMARY KEY)`); err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys, restarts := scale(400, 4000), scale(1, 5)
	var retried, handled atomic.Int64
	handle := func(key string) error {
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := c.WithTx(tx).Do(ctx, "restart", key, func(ctx context.Context) (any, error) {
				_, err := tx.Exec(ctx, `INSERT INTO effects VALUES ($1)`, key)
				return nil, err
			})
			return err
		})
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; i < keys*3; i += 8 { // every key three times
				key := fmt.Sprintf("k%05d", i%keys)
				for {
					err := handle(key)
					if err == nil {
						handled.Add(1)
						break
					}
					if !retryable(err) {
						t.Errorf("%s: not retryable: %v", key, err)
						return
					}
					retried.Add(1)
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	go func() { wg.Wait(); close(done) }()
	// Restart while the load runs: each time a further share of the
	// deliveries is done.
	total := int64(keys * 3)
	for i := range restarts {
		for handled.Load() < total*int64(i+1)/int64(restarts+2) {
			time.Sleep(5 * time.Millisecond)
		}
		if err := cl.Restart(ctx); err != nil {
			t.Fatal(err)
		}
	}
	<-done
	after := mustPool(cl.URL("postgres")) // the old pool may hold connections the restart cut
	defer after.Close()
	effects := count(t, after, `SELECT count(*) FROM effects`)
	completed := count(t, after, `SELECT count(*) FROM idem.processed_events WHERE source = 'restart' AND status = 'completed'`)
	t.Logf("restart: %d keys, %d restarts, %d retried deliveries, %d effects, %d completed keys", keys, restarts, retried.Load(), effects, completed)
	if effects != keys || completed != keys {
		t.Fatalf("want %d effects and completed keys", keys)
	}
	if retried.Load() == 0 {
		t.Fatal("no delivery hit the restart; the test proves nothing")
	}
}

// retryable: errors a client sees while the server restarts.
func retryable(err error) bool {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code == "57P01" || pg.Code == "57P02" || pg.Code == "57P03" || strings.HasPrefix(pg.Code, "08") || pg.Code == "40001"
	}
	return errors.Is(err, idem.ErrSerialization) || pgconn.SafeToRetry(err) || isConnErr(err)
}

func isConnErr(err error) bool {
	s := err.Error()
	for _, frag := range []string{"connection refused", "unexpected EOF", "broken pipe", "connection reset", "closed", "conn busy", "failed to connect", "the database system is", "terminating connection"} {
		if strings.Contains(s, frag) {
			return true
		}
	}
	return false
}

// TestThroughPgBouncer: the library, prune and rotation all work through
// PgBouncer in transaction pooling mode.
func TestThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	direct := testdb.Pool(t, url, 4)
	var db string
	if err := direct.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	if _, err := direct.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(-3)); err != nil {
		t.Fatal(err)
	}
	if _, err := direct.Exec(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at)
		SELECT 'old', 'o' || g, $1::date, 'completed', g, $1::date, now(), now() - interval '1 day' FROM generate_series(1, 3000) g`, monthStart(0)); err != nil {
		t.Fatal(err)
	}
	bouncer := testdb.PgBouncer(t, db)
	bp := testdb.Pool(t, bouncer, 24)
	c, err := idem.New(bp, nil)
	if err != nil {
		t.Fatal(err)
	}
	var runs sync.Map
	var wg sync.WaitGroup
	for k := range 200 {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				key := fmt.Sprintf("b%03d", k)
				for {
					_, err := c.Do(ctx, "bouncer", key, func(context.Context) (any, error) {
						n, _ := runs.LoadOrStore(key, new(atomic.Int64))
						n.(*atomic.Int64).Add(1)
						return 1, nil
					})
					if errors.Is(err, idem.ErrInProgress) {
						time.Sleep(5 * time.Millisecond)
						continue
					}
					if err != nil {
						t.Error(err)
					}
					return
				}
			}()
		}
	}
	wg.Wait()
	runs.Range(func(k, v any) bool {
		if v.(*atomic.Int64).Load() != 1 {
			t.Errorf("%s ran %d times through PgBouncer", k, v.(*atomic.Int64).Load())
		}
		return true
	})
	// Maintenance as idemctl runs it through PgBouncer (exec mode).
	mp := testdb.Pool(t, bouncer+testdb.ExecMode, 4)
	pr, err := prune.Run(ctx, mp, prune.Config{BatchSize: new(1000)})
	if err != nil || pr.Deleted != 3000 {
		t.Fatalf("prune through PgBouncer: %+v %v", pr, err)
	}
	rr, err := partition.Rotate(ctx, mp, partition.Config{})
	if err != nil || !strings.Contains(fmt.Sprint(rr.Steps), "dropped") {
		t.Fatalf("rotate through PgBouncer: %+v %v", rr, err)
	}
}
