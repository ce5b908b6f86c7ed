package reliability

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testdb"
)

// monthRace claims hot keys from many connections, each claim at a clock
// either just before or just after a month's end, so that deliveries of one
// key land in both months; every key must be acquired exactly once. It
// returns the number of keys acquired more than once.
//
// Statistical power matters (the issue: 1,000 keys with ~8 deliveries each
// did not catch an unsafe variant): each period has few hot keys that every
// worker hammers, and the side of the month end a worker's clock is on
// flips every 1.5-2 s.
func monthRace(t *testing.T, pool *pgxpool.Pool, isolation pgx.TxIsoLevel, workers, keysPerPeriod int, run time.Duration) (doubles, acquired, deliveries int) {
	t.Helper()
	ctx := context.Background()
	end := testdb.MonthStart(time.Now(), 1)
	before := end.Add(-400 * time.Millisecond).Format(time.RFC3339Nano)
	after := end.Add(400 * time.Millisecond).Format(time.RFC3339Nano)

	var (
		mu     sync.Mutex
		counts = map[string]int{}
		period atomic.Int64
		flip   atomic.Bool
		total  atomic.Int64
		fails  atomic.Int64
	)
	stop := make(chan struct{})
	go func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(1500+rand.IntN(500)) * time.Millisecond):
				period.Add(1)
				flip.Store(!flip.Load())
			}
		}
	}()
	var wg sync.WaitGroup
	deadline := time.Now().Add(run)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for time.Now().Before(deadline) {
				p := period.Load()
				key := fmt.Sprintf("race-%d-%d", p, rand.IntN(keysPerPeriod))
				// Half the workers on each side, swapped at each flip.
				at := before
				if (w%2 == 0) != flip.Load() {
					at = after
				}
				var outcome string
				err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: isolation}, func(tx pgx.Tx) error {
					if _, err := tx.Exec(ctx, `SELECT set_config('idem.test_now', $1, true)`, at); err != nil {
						return err
					}
					return tx.QueryRow(ctx, `SELECT outcome FROM idem.claim('race', $1, lease => interval '1 hour')`, key).Scan(&outcome)
				})
				var pgErr *pgconn.PgError
				if errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01" || pgErr.Code == "53200") {
					// A serialization failure, or SSI's shared memory full
					// (53200, parallel tests on one server): nothing was
					// committed; the sender retries.
					continue
				}
				if err != nil {
					fails.Add(1)
					t.Errorf("claim %s: %v", key, err)
					return
				}
				total.Add(1)
				if outcome == "acquired" {
					mu.Lock()
					counts[key]++
					mu.Unlock()
				}
			}
		}(w)
	}
	wg.Wait()
	close(stop)
	for _, n := range counts {
		acquired++
		if n > 1 {
			doubles++
		}
	}
	return doubles, acquired, int(total.Load())
}

// TestMonthBoundaryRace: claim v2 probes only the months a live row can be
// in, and inserts into the current month first; deliveries of one key on
// both sides of a month's end, racing from 32 connections, still run the
// work once. At READ COMMITTED and SERIALIZABLE. The negative control
// removes the cross-month guard (the probe looks only at the current month)
// and must see keys acquired twice, or the race is not strong enough to
// prove anything.
func TestMonthBoundaryRace(t *testing.T) {
	t.Parallel()
	run := time.Duration(scale(6, 60)) * time.Second
	for _, tc := range []struct {
		name string
		iso  pgx.TxIsoLevel
	}{{"read committed", pgx.ReadCommitted}, {"serializable", pgx.Serializable}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			url := testdb.New(t)
			pool := testdb.Pool(t, url, 40)
			doubles, acquired, deliveries := monthRace(t, pool, tc.iso, 32, 60, run)
			t.Logf("%s: %d deliveries, %d keys acquired, %d acquired twice", tc.name, deliveries, acquired, doubles)
			if doubles != 0 {
				t.Fatalf("%d keys were acquired more than once", doubles)
			}
			if acquired < 100 || deliveries < 20*acquired/10 {
				t.Fatalf("too little racing to prove anything: %d keys, %d deliveries", acquired, deliveries)
			}
		})
	}
	t.Run("negative control: no cross-month guard", func(t *testing.T) {
		t.Parallel()
		url := testdb.New(t)
		pool := testdb.Pool(t, url, 40)
		ctx := context.Background()
		// The guard is in idem.claim's short path and in idem.claim_general
		// (migration 27), which takes every claim that meets a held lock.
		for _, g := range []struct{ fn, guard string }{
			{"idem.claim", "AND e.first_seen_month >= idem.window_start(v_now, s.lookback)\n       AND e.first_seen_month <= idem.utc_month(v_now + interval '1 day')"},
			{"idem.claim_general", "AND e.first_seen_month >= v_lo AND e.first_seen_month <= v_hi"},
		} {
			var def string
			if err := pool.QueryRow(ctx, `SELECT pg_get_functiondef('`+g.fn+`(text,text,text,interval,interval,text,interval)'::regprocedure)`).Scan(&def); err != nil {
				t.Fatal(err)
			}
			if strings.Count(def, g.guard) != 1 {
				t.Fatalf("%s's window predicate changed; update the negative control:\n%s", g.fn, def)
			}
			if _, err := pool.Exec(ctx, strings.Replace(def, g.guard, "AND e.first_seen_month = idem.utc_month(v_now)", 1)); err != nil {
				t.Fatal(err)
			}
		}
		doubles, acquired, deliveries := monthRace(t, pool, pgx.ReadCommitted, 32, 60, run)
		t.Logf("without the guard: %d deliveries, %d keys acquired, %d acquired twice", deliveries, acquired, doubles)
		if doubles == 0 {
			t.Fatal("the race did not catch a claim without the cross-month guard: it proves nothing")
		}
	})
}

// TestLookback: a key is found as long as it is live, however far back its
// month: at its source's full retention, after the retention was raised,
// with a longer ttl passed to the claim, and after its lease was extended
// (by extend and by a reacquire) past the original retention. Under three
// server time zones.
func TestLookback(t *testing.T) {
	t.Parallel()
	for _, tz := range []string{"UTC", "America/Adak", "Pacific/Kiritimati"} {
		t.Run(tz, func(t *testing.T) {
			t.Parallel()
			url := testdb.New(t)
			ctx := context.Background()
			admin := testdb.Pool(t, url, 4)
			var db string
			if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
				t.Fatal(err)
			}
			if _, err := admin.Exec(ctx, `ALTER DATABASE `+pgx.Identifier{db}.Sanitize()+` SET timezone = `+pgx.Identifier{tz}.Sanitize()); err != nil {
				t.Fatal(err)
			}
			t0 := testdb.MonthStart(time.Now(), 0).Add(-36 * time.Hour) // late in the previous month
			at := func(d time.Duration) *pgxpool.Pool { return testdb.PoolAt(t, url, 2, t0.Add(d)) }
			day := 24 * time.Hour
			claim := func(pool *pgxpool.Pool, source, key string, args string) (outcome string, token int64) {
				t.Helper()
				var tok *int64
				if err := pool.QueryRow(ctx, `SELECT outcome, token FROM idem.claim($1, $2`+args+`)`, source, key).Scan(&outcome, &tok); err != nil {
					t.Fatalf("claim %s/%s: %v", source, key, err)
				}
				if tok != nil {
					token = *tok
				}
				return outcome, token
			}
			complete := func(pool *pgxpool.Pool, source, key string, token int64) {
				t.Helper()
				var s string
				if err := pool.QueryRow(ctx, `SELECT idem.complete($1, $2, $3, '{}')`, source, key, token).Scan(&s); err != nil || s != "completed" {
					t.Fatalf("complete %s/%s: %q %v", source, key, s, err)
				}
			}
			if _, err := admin.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES
				('long', '200 days', '1 minute'), ('raised', '10 days', '1 minute'), ('ext', '7 days', '7 days'),
				('re', '30 days', '7 days')`); err != nil {
				t.Fatal(err)
			}

			// A key at its source's full retention: claimed at t0, asked
			// 199 days later (seven months on), it is a duplicate.
			p0 := at(0)
			_, tok := claim(p0, "long", "k", "")
			complete(p0, "long", "k", tok)
			if o, _ := claim(at(199*day), "long", "k", ""); o != "completed" {
				t.Errorf("a key 199 days into a 200-day retention: %s, want completed", o)
			}
			if o, _ := claim(at(201*day), "long", "k", ""); o != "acquired" {
				t.Errorf("a key past its retention: %s, want acquired", o)
			}

			// The retention raised after keys were stored: the new ttl
			// applies to new keys, which are found for all of it.
			if _, err := admin.Exec(ctx, `UPDATE idem.policies SET ttl = '120 days' WHERE source = 'raised'`); err != nil {
				t.Fatal(err)
			}
			_, tok = claim(p0, "raised", "k", "")
			complete(p0, "raised", "k", tok)
			if o, _ := claim(at(100*day), "raised", "k", ""); o != "completed" {
				t.Errorf("a key 100 days into a retention raised to 120 days: %s, want completed", o)
			}

			// A longer ttl passed to the claim than any policy has.
			_, tok = claim(p0, "raised", "explicit", ", ttl => interval '300 days'")
			complete(p0, "raised", "explicit", tok)
			if o, _ := claim(at(250*day), "raised", "explicit", ""); o != "completed" {
				t.Errorf("a key 250 days into its own 300-day ttl: %s, want completed", o)
			}

			// Extends past the original retention (7 days) and past the
			// default policy's (30 days), which every source's lookback
			// includes: the key stays in progress 36 days on.
			_, tok = claim(p0, "ext", "k", "")
			for d := 6 * day; d <= 30*day; d += 6 * day {
				var o string
				if err := at(d).QueryRow(ctx, `SELECT outcome FROM idem.extend('ext', 'k', $1, interval '7 days')`, tok).Scan(&o); err != nil || o != "extended" {
					t.Fatalf("extend at +%s: %q %v", d, o, err)
				}
			}
			if o, _ := claim(at(36*day), "ext", "k", ""); o != "in_progress" {
				t.Errorf("a key whose lease was extended to +37 days, at +36 days: %s, want in_progress", o)
			}
			// A reacquire that pushes expires_at past the retention: a
			// 30-day key whose lease was lost is taken over at +29 days with
			// a 7-day lease and asked again at +35 days.
			_, _ = claim(p0, "re", "k", "")
			o, tok2 := claim(at(29*day), "re", "k", "")
			if o != "acquired" {
				t.Fatalf("reacquire after the lease: %s", o)
			}
			if o, _ := claim(at(35*day), "re", "k", ""); o != "in_progress" {
				t.Errorf("a reacquired key at +35 days (lease to +36): %s, want in_progress", o)
			}
			complete(at(35*day), "re", "k", tok2)
			if o, _ := claim(at(35*day+time.Hour), "re", "k", ""); o != "completed" {
				t.Errorf("the reacquired key completed: %s", o)
			}
		})
	}
}
