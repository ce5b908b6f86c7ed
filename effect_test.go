package idem_test

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// counter counts calls per name.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) inc(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[name]++
}

func (c *counter) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

// TestEffectOncePerEvent: an event's work fails after its effects ran,
// and runs again three times; each effect ran once, and every run saw the
// first run's results.
func TestEffectOncePerEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var ran counter
	var charges []string
	for run := 1; run <= 4; run++ {
		_, err := c.Do(ctx, "stripe", "evt_once", func(ctx context.Context) (any, error) {
			if _, err := c.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) {
				ran.inc("send_receipt")
				return nil, nil
			}); err != nil {
				return nil, err
			}
			id, err := idem.EffectValue(ctx, c, "charge", func(ctx context.Context) (string, error) {
				ran.inc("charge")
				return "ch_" + time.Now().Format("150405.000000000"), nil
			})
			if err != nil {
				return nil, err
			}
			charges = append(charges, id)
			if run < 4 {
				return nil, errors.New("the database write after the effects failed")
			}
			return id, nil
		})
		if (err != nil) != (run < 4) {
			t.Fatalf("run %d: %v", run, err)
		}
	}
	if ran.get("send_receipt") != 1 || ran.get("charge") != 1 {
		t.Fatalf("effects ran %v times, want once each", ran.n)
	}
	for _, id := range charges[1:] {
		if id != charges[0] {
			t.Fatalf("charge ids across runs: %v, want the first run's on every replay", charges)
		}
	}
	// The effects are keys of their own, next to the event's.
	rows, _ := pool.Query(ctx, `SELECT source || ' ' || key || ' ' || status FROM idem.processed_events ORDER BY 1`)
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	want := []string{"stripe evt_once completed", "stripe/effects charge/evt_once completed", "stripe/effects send_receipt/evt_once completed"}
	if err != nil || strings.Join(keys, "|") != strings.Join(want, "|") {
		t.Fatalf("keys %q (%v), want %q", keys, err, want)
	}
}

// TestEffectRaces: 32 runs of one event's work race, each holding the
// event (as after lease takeovers, or two consumers of one stream), each
// running three effects: each effect runs once. The others are told the
// effect is in progress, or get its stored result.
func TestEffectRaces(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, err := idem.New(testdb.Pool(t, testdb.New(t), 40), nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := c.Claim(ctx, "shop", "order-7")
	if err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("claim: %+v %v", cl, err)
	}
	evCtx := idem.WithEvent(ctx, cl)
	var ran counter
	var inProgress, replayed atomic.Int64
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			for _, name := range []string{"reserve_stock", "charge", "notify_crm"} {
				res, err := c.Effect(evCtx, name, func(ctx context.Context) (any, error) {
					ran.inc(name)
					time.Sleep(20 * time.Millisecond) // widen the race
					return name + " done", nil
				})
				switch {
				case errors.Is(err, idem.ErrInProgress):
					inProgress.Add(1)
				case err != nil:
					t.Error(err)
				case res.Replayed:
					replayed.Add(1)
				}
			}
		}()
	}
	close(start)
	wg.Wait()
	for _, name := range []string{"reserve_stock", "charge", "notify_crm"} {
		if n := ran.get(name); n != 1 {
			t.Errorf("%s ran %d times, want 1", name, n)
		}
	}
	t.Logf("32 racing runs x 3 effects: %d told in progress, %d replayed", inProgress.Load(), replayed.Load())

	// And racing re-runs through Do: the event's own gate, then each
	// effect's, hold together.
	var ran2 counter
	wg = sync.WaitGroup{}
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := c.Do(ctx, "shop", "order-8", func(ctx context.Context) (any, error) {
				return c.Effect(ctx, "charge", func(context.Context) (any, error) { ran2.inc("charge"); return nil, nil })
			})
			if err != nil && !errors.Is(err, idem.ErrInProgress) {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if ran2.get("charge") != 1 {
		t.Fatalf("charge under racing Do ran %d times", ran2.get("charge"))
	}
}

// TestEffectAfterCrash: a worker died inside an effect (its claim stays,
// no outcome). After the lease, the next run runs it again as attempt 2
// with the same outbound key; under AtMostOnce it is not run again, and
// is reported in doubt from then on.
func TestEffectAfterCrash(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	now := time.Now()
	dead, err := idem.New(testdb.PoolAt(t, url, 2, now), nil)
	if err != nil {
		t.Fatal(err)
	}
	later, err := idem.New(testdb.PoolAt(t, url, 2, now.Add(time.Hour)), nil)
	if err != nil {
		t.Fatal(err)
	}

	ev, err := dead.Claim(ctx, "stripe", "evt_crash")
	if err != nil || ev.Outcome != idem.Acquired {
		t.Fatalf("claim: %+v %v", ev, err)
	}
	for _, name := range []string{"charge", "send_receipt"} {
		// What a process killed inside the effect leaves behind.
		src, key, err := idem.EffectKey("stripe", "evt_crash", name)
		if err != nil {
			t.Fatal(err)
		}
		if cl, err := dead.Claim(ctx, src, key); err != nil || cl.Outcome != idem.Acquired {
			t.Fatalf("effect claim: %+v %v", cl, err)
		}
	}
	firstKey := idem.Effect{Name: "charge", EventSource: "stripe", EventKey: "evt_crash"}.OutboundKey("POST /v1/charges")

	// Still within the effect's lease: another run is told to wait.
	if _, err := dead.Effect(idem.WithEvent(ctx, ev), "charge", func(context.Context) (any, error) {
		t.Error("ran within the lease")
		return nil, nil
	}); !errors.Is(err, idem.ErrInProgress) {
		t.Fatalf("within the lease: %v, want ErrInProgress", err)
	}

	t.Run("at least once", func(t *testing.T) {
		var seen idem.Effect
		res, err := later.Effect(idem.WithEvent(ctx, ev), "charge", func(ctx context.Context) (any, error) {
			seen, _ = idem.EffectFrom(ctx)
			return "ch_1", nil
		})
		if err != nil || res.Replayed {
			t.Fatalf("re-run: %+v %v", res, err)
		}
		if seen.Attempt != 2 || seen.OutboundKey("POST /v1/charges") != firstKey {
			t.Fatalf("re-run saw %+v, key %s; want attempt 2 and key %s", seen, seen.OutboundKey("POST /v1/charges"), firstKey)
		}
	})
	t.Run("at most once", func(t *testing.T) {
		for run := range 3 {
			_, err := later.Effect(idem.WithEvent(ctx, ev), "send_receipt", func(context.Context) (any, error) {
				t.Error("an AtMostOnce effect in doubt ran again")
				return nil, nil
			}, idem.AtMostOnce())
			if !errors.Is(err, idem.ErrInDoubt) || !errors.Is(err, idem.ErrFailed) {
				t.Fatalf("run %d: %v, want ErrInDoubt and ErrFailed", run, err)
			}
			var ee *idem.EffectError
			if !errors.As(err, &ee) || ee.Name != "send_receipt" || ee.EventKey != "evt_crash" {
				t.Fatalf("run %d: %#v, want an *EffectError naming the effect", run, err)
			}
		}
	})
	t.Run("at most once, fn fails", func(t *testing.T) {
		calls := 0
		for range 2 {
			_, err := later.Effect(idem.WithEvent(ctx, ev), "wire_transfer", func(context.Context) (any, error) {
				calls++
				return nil, errors.New("bank: timeout")
			}, idem.AtMostOnce())
			if err == nil || errors.Is(err, idem.ErrInDoubt) {
				t.Fatalf("err = %v", err)
			}
		}
		if calls != 1 {
			t.Fatalf("called %d times, want 1", calls)
		}
	})
}

// TestEffectOutsideTheEventTransaction: an event claimed inside the app's
// transaction runs an effect, then the transaction rolls back. The effect
// stays recorded (the email went), and the event's next run replays it.
func TestEffectOutsideTheEventTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var sent counter
	for run := 1; run <= 2; run++ {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := c.WithTx(tx).Do(ctx, "stripe", "evt_tx", func(ctx context.Context) (any, error) {
				if _, err := c.Effect(ctx, "send_receipt", func(context.Context) (any, error) {
					sent.inc("mail")
					return nil, nil
				}); err != nil {
					return nil, err
				}
				// On the transaction-bound client, Effect refuses.
				if _, err := c.WithTx(tx).Effect(ctx, "other", func(context.Context) (any, error) { return nil, nil }); !errors.Is(err, idem.ErrEffectNeedsPool) {
					t.Errorf("Effect on a tx client: %v, want ErrEffectNeedsPool", err)
				}
				return nil, nil
			})
			if err != nil {
				return err
			}
			if run == 1 {
				return errors.New("the business write failed: roll back")
			}
			return nil
		})
		if (err != nil) != (run == 1) {
			t.Fatalf("run %d: %v", run, err)
		}
	}
	if sent.get("mail") != 1 {
		t.Fatalf("mail sent %d times, want 1", sent.get("mail"))
	}
}

// TestEffectBadInput: every misuse is a clear error, before anything is
// claimed.
func TestEffectBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, err := idem.New(testdb.Pool(t, testdb.New(t), 2), nil)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := c.Claim(ctx, "stripe", "evt_bad")
	if err != nil {
		t.Fatal(err)
	}
	nop := func(context.Context) (any, error) { t.Error("ran"); return nil, nil }
	if _, err := c.Effect(ctx, "mail", nop); !errors.Is(err, idem.ErrNoEvent) {
		t.Errorf("no event: %v", err)
	}
	for _, name := range []string{"", "send receipt", "a/b", strings.Repeat("x", 65), "é"} {
		if _, err := c.Effect(idem.WithEvent(ctx, ev), name, nop); !errors.Is(err, idem.ErrInvalidInput) {
			t.Errorf("name %q: %v, want ErrInvalidInput", name, err)
		}
	}
	long := *ev
	long.Source = strings.Repeat("s", 60)
	if _, err := c.Effect(idem.WithEvent(ctx, &long), "mail", nop); !errors.Is(err, idem.ErrInvalidInput) || !strings.Contains(err.Error(), "at most 56") {
		t.Errorf("long source: %v", err)
	}
	// A long event key gets a hashed effect key, still one per event.
	longKey := strings.Repeat("k", 512)
	src, key, err := idem.EffectKey("stripe", longKey, "mail")
	if err != nil || src != "stripe/effects" || !strings.HasPrefix(key, "mail/sha256:") || len(key) > 512 {
		t.Fatalf("EffectKey of a long key: %q %q %v", src, key, err)
	}
	other, _, _ := idem.EffectKey("stripe", longKey[:511]+"j", "mail")
	if other == key {
		t.Fatal("two long keys share an effect key")
	}
}

// TestEffectKeysCannotCollide: the hashed effect key of a long event key
// is the plain form of no other event's key. An event keyed
// "sha256:<hex of the long key's SHA-256>" (a valid 71-byte key) has an
// effect of its own: it runs, and is not answered with the other event's
// result.
func TestEffectKeysCannotCollide(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	longKey := strings.Repeat("k", 510) // "charge/"+key is over 512 bytes: hashed
	sum := sha256.Sum256([]byte(longKey))
	lookalike := "sha256:" + hex.EncodeToString(sum[:])
	var charges []string
	for _, key := range []string{longKey, lookalike} {
		_, err := c.Do(ctx, "stripe", key, func(ctx context.Context) (any, error) {
			return c.Effect(ctx, "charge", func(context.Context) (any, error) {
				charges = append(charges, key[:10])
				return key[:10], nil
			})
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(charges) != 2 {
		t.Fatalf("charges run: %q, want one per event", charges)
	}
	_, a, _ := idem.EffectKey("stripe", longKey, "charge")
	_, b, _ := idem.EffectKey("stripe", lookalike, "charge")
	if a == b {
		t.Fatalf("two events share the effect key %q", a)
	}
}

// TestEffectPoolExhausted: events whose work runs in the caller's
// transaction hold every connection of the pool, and each calls Effect,
// which needs one more. Unbounded, none would ever get one (until their
// contexts end); the effect's claim waits Config.EffectAcquireWait, fails
// with ErrNoConnection naming the pool's size, the transactions end, and
// the redeliveries complete every event with its effect run once.
func TestEffectPoolExhausted(t *testing.T) {
	t.Parallel()
	const events = 4
	cfg := &idem.Config{EffectAcquireWait: 200 * time.Millisecond}
	url := testdb.New(t)
	drivers := map[string]func(t *testing.T) (*idem.Client, func(ctx context.Context, key string, work func(context.Context) (any, error)) error){
		"pgx": func(t *testing.T) (*idem.Client, func(context.Context, string, func(context.Context) (any, error)) error) {
			pool := testdb.Pool(t, url, events)
			c := testdb.Client(t, pool, cfg)
			return c, func(ctx context.Context, key string, work func(context.Context) (any, error)) error {
				return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					_, err := c.WithTx(tx).Do(ctx, "stripe", key, work)
					return err
				})
			}
		},
		"database/sql": func(t *testing.T) (*idem.Client, func(context.Context, string, func(context.Context) (any, error)) error) {
			db, err := sql.Open("pgx", url)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { db.Close() })
			db.SetMaxOpenConns(events)
			c := testdb.SQLClient(t, db, cfg)
			return c, func(ctx context.Context, key string, work func(context.Context) (any, error)) error {
				tx, err := db.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer tx.Rollback()
				if _, err := c.WithSQLTx(tx).Do(ctx, "stripe", key, work); err != nil {
					return err
				}
				return tx.Commit()
			}
		},
	}
	for name, open := range drivers {
		t.Run(name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			c, deliver := open(t)
			var sent counter
			var exhausted atomic.Int32
			// The first delivery of every event holds its transaction's
			// connection until all of them do: then every Effect finds
			// the pool empty.
			var inTx, tried sync.WaitGroup
			inTx.Add(events)
			tried.Add(events)
			var wg sync.WaitGroup
			for i := range events {
				wg.Add(1)
				go func() {
					defer wg.Done()
					key := fmt.Sprintf("evt_pool_%s_%d", strings.ReplaceAll(name, "/", "_"), i)
					first := true
					for attempt := 1; ; attempt++ {
						err := deliver(ctx, key, func(ctx context.Context) (any, error) {
							wasFirst := first
							if first {
								first = false
								inTx.Done()
								inTx.Wait()
							}
							_, err := c.Effect(ctx, "send_receipt", func(context.Context) (any, error) {
								sent.inc(key)
								return nil, nil
							})
							if wasFirst {
								// No first delivery gives its connection back
								// before every one has tried its effect, so none
								// finds one freed by another's failure, however
								// late it was scheduled.
								tried.Done()
								tried.Wait()
							}
							return nil, err
						})
						if err == nil {
							return
						}
						if errors.Is(err, idem.ErrNoConnection) {
							exhausted.Add(1)
							if !strings.Contains(err.Error(), fmt.Sprintf("a pool of %d", events)) || !strings.Contains(err.Error(), "EffectAcquireWait") {
								t.Errorf("%s: the error does not say how to size the pool: %v", key, err)
							}
						} else if !errors.Is(err, idem.ErrInProgress) {
							t.Errorf("%s attempt %d: %v", key, attempt, err)
							return
						}
						if ctx.Err() != nil {
							t.Errorf("%s: not done before the test's deadline (deadlocked?): %v", key, err)
							return
						}
						time.Sleep(time.Duration(rand.IntN(50)) * time.Millisecond)
					}
				}()
			}
			wg.Wait()
			if exhausted.Load() < events {
				t.Errorf("%d deliveries failed with ErrNoConnection, want at least %d (every first one)", exhausted.Load(), events)
			}
			for i := range events {
				key := fmt.Sprintf("evt_pool_%s_%d", strings.ReplaceAll(name, "/", "_"), i)
				if n := sent.get(key); n != 1 {
					t.Errorf("%s: effect ran %d times, want 1", key, n)
				}
			}
		})
	}
}

// TestEffectScopes: the effect a context carries is the innermost one of
// the innermost event. A Do, a DoBatch or a WithEvent started inside an
// effect's function starts a new scope with no effect (until its own work
// calls Effect), so the outbound keys of the outer effect never reach
// another event's calls; an effect started inside another effect of the
// same event is in force in its own function; back in the outer function,
// the outer effect is in force again.
func TestEffectScopes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 6), nil)
	var seen []string
	note := func(where string, ctx context.Context) {
		ev, hasEvent := idem.EventFrom(ctx)
		eff, hasEffect := idem.EffectFrom(ctx)
		s := where + ":"
		if hasEvent {
			s += " event " + ev.Source + "/" + ev.Key
		}
		if hasEffect {
			s += " effect " + eff.Name + " of " + eff.EventKey
		}
		seen = append(seen, s)
	}
	_, err := c.Do(ctx, "shop", "order-1", func(ctx context.Context) (any, error) {
		note("order", ctx)
		return c.Effect(ctx, "notify", func(ctx context.Context) (any, error) {
			note("notify", ctx)
			_, err := c.Do(ctx, "sms", "order-1/alice", func(ctx context.Context) (any, error) {
				note("inner Do", ctx)
				return c.Effect(ctx, "send", func(ctx context.Context) (any, error) {
					note("inner effect", ctx)
					return nil, nil
				})
			})
			if err != nil {
				return nil, err
			}
			_, err = c.DoBatch(ctx, "sms", []idem.BatchItem{{Key: "order-1/bob"}}, func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
				note("DoBatch", ctx)
				note("batch item", idem.WithEvent(ctx, acquired[0]))
				return make([]idem.WorkResult, len(acquired)), nil
			})
			if err != nil {
				return nil, err
			}
			ev, _ := idem.EventFrom(ctx)
			note("WithEvent", idem.WithEvent(ctx, ev))
			if _, err := c.Effect(ctx, "audit", func(ctx context.Context) (any, error) {
				note("nested effect", ctx)
				return nil, nil
			}); err != nil {
				return nil, err
			}
			note("notify again", ctx)
			return nil, nil
		})
	})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"order: event shop/order-1",
		"notify: event shop/order-1 effect notify of order-1",
		"inner Do: event sms/order-1/alice",
		"inner effect: event sms/order-1/alice effect send of order-1/alice",
		"DoBatch:",
		"batch item: event sms/order-1/bob",
		"WithEvent: event shop/order-1",
		"nested effect: event shop/order-1 effect audit of order-1",
		"notify again: event shop/order-1 effect notify of order-1",
	}
	if strings.Join(seen, "\n") != strings.Join(want, "\n") {
		t.Fatalf("scopes seen:\n%s\nwant:\n%s", strings.Join(seen, "\n"), strings.Join(want, "\n"))
	}
}
