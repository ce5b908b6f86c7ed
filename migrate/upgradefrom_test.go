package migrate_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestUpgradeFrom23EveryState: version 23 holding keys in every state (see
// buildEveryState: in flight, a crashed worker's, completed with and
// without a result, failed retryable and permanently, at max_attempts,
// mismatched, expired, never seen, held by the inbox queued, taken and
// dead, adopted from a legacy table being adopted, waited on), of sources
// with ttls of 7, 30, 90 and 400 days, in the current month, earlier
// months, the default partition and months before a source's window, is
// migrated up to the latest version: every key answers as before, field by
// field (claim, peek, and complete, fail and extend with the key's last
// token); then every in-flight key completes with the token its worker got
// before the upgrade, and each waiter registered before is woken.
func TestUpgradeFrom23EveryState(t *testing.T) { testUpgradeEveryState(t, 23) }

// TestUpgradeFrom26EveryState: the same, from version 26.
func TestUpgradeFrom26EveryState(t *testing.T) { testUpgradeEveryState(t, 26) }

// TestUpgradeFrom28EveryState: the same, from version 28 (the batch's
// short path, migration 29: every key answers its batch as before too).
func TestUpgradeFrom28EveryState(t *testing.T) { testUpgradeEveryState(t, 28) }

func testUpgradeEveryState(t *testing.T, from int64) {
	t.Parallel()
	ctx := context.Background()
	url, _, p := setupAt(t)
	s := buildEveryState(t, ctx, url, p, from)
	t.Logf("version %d: %d keys in %d states: %s", from, len(s.Keys), len(s.States()), strings.Join(s.States(), "; "))
	s.check(t, ctx, fmt.Sprintf("version %d, probed again", from))
	res, err := p.Up(ctx)
	if err != nil {
		t.Fatalf("migrate up from %d: %v", from, err)
	}
	if v, err := p.GetDBVersion(ctx); err != nil || v != migrate.Latest() {
		t.Fatalf("after the upgrade: version %d (%v), want %d", v, err, migrate.Latest())
	}
	s.check(t, ctx, fmt.Sprintf("after %d steps up from %d to %d", len(res), from, migrate.Latest()))
	s.finish(t, ctx)
}

// TestUpgradeFrom23EveryStateDownAndUp: the every-state fixture at version
// 23, up to the latest version, down to 23 again and up again (as an
// operator rolling a deploy back does, goose's Provider: no guard): every
// key answers as at 23 at each stage, and the in-flight keys complete
// with their tokens at the end.
func TestUpgradeFrom23EveryStateDownAndUp(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, _, p := setupAt(t)
	s := buildEveryState(t, ctx, url, p, 23)
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("migrate up from 23: %v", err)
	}
	s.check(t, ctx, fmt.Sprintf("up at %d", migrate.Latest()))
	if _, err := p.DownTo(ctx, 23); err != nil {
		t.Fatalf("migrate down to 23: %v", err)
	}
	s.check(t, ctx, "down at 23 again")
	if _, err := p.Up(ctx); err != nil {
		t.Fatalf("migrate up again: %v", err)
	}
	s.check(t, ctx, fmt.Sprintf("up at %d again", migrate.Latest()))
	s.finish(t, ctx)
}

// TestUpgradeFrom23EveryStateUnderClaims: the every-state fixture at
// version 23, migrated up (migrate.New's Migrator, as idemctl migrate up
// runs it) while 4 clients claim every key of the fixture and 200 new keys
// over and over, at the fixture's time, and each in-flight key's worker
// completes it with its token: no key is acquired twice, a key acquired is
// one the fixture answered "acquired" for (or a new one, each acquired
// once), every claim error is one idem documents (40001, retried), and
// afterwards every key answers for what happened to it.
func TestUpgradeFrom23EveryStateUnderClaims(t *testing.T) {
	t.Parallel()
	const (
		clients = 4
		newKeys = 200
	)
	ctx := context.Background()
	url, db, p := setupAt(t)
	s := buildEveryState(t, ctx, url, p, 23)

	type target struct {
		k     everyKey
		fresh bool
	}
	var targets []target
	for _, k := range s.Keys {
		targets = append(targets, target{k: k})
	}
	for i := range newKeys {
		targets = append(targets, target{k: everyKey{State: "new", Source: everySources[i%len(everySources)].name, Key: fmt.Sprintf("new-%d", i)}, fresh: true})
	}
	pool := testdb.PoolAt(t, url, clients+2, s.At)

	var (
		mu        sync.Mutex
		acquired  = map[string][]string{} // key id -> the clients that acquired it
		errs      []string
		retried   atomic.Int64
		claims    atomic.Int64
		during    atomic.Int64 // claims that began while the migration ran
		migrating atomic.Bool
		done      atomic.Bool
		passes    [clients]atomic.Int64
		wg        sync.WaitGroup
	)
	claimOnce := func(c int, tg target) {
		k := tg.k
		for try := 0; ; try++ {
			var outcome string
			var token *int64
			err := pool.QueryRow(ctx, `SELECT outcome, token FROM idem.claim($1, $2, fingerprint => nullif($3, ''))`, k.Source, k.Key, k.ProbeFP).Scan(&outcome, &token)
			claims.Add(1)
			if migrating.Load() {
				during.Add(1)
			}
			if c := sqlstate.Of(err); c == sqlstate.SerializationFailure && try < 10 {
				retried.Add(1) // "the key kept changing under the claim": retry, as documented
				continue
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, fmt.Sprintf("client %d: claim %s (migrating %v): %v", c, k.id(), migrating.Load(), describe(err)))
				mu.Unlock()
				return
			}
			if outcome == "acquired" {
				mu.Lock()
				acquired[k.id()] = append(acquired[k.id()], fmt.Sprintf("client %d (migrating %v)", c, migrating.Load()))
				mu.Unlock()
				var out string
				if err := pool.QueryRow(ctx, `SELECT idem.complete($1, $2, $3, jsonb_build_object('by', $4::int))`, k.Source, k.Key, *token, c).Scan(&out); err != nil || out != "completed" {
					mu.Lock()
					errs = append(errs, fmt.Sprintf("client %d: complete %s: %q %v", c, k.id(), out, describe(err)))
					mu.Unlock()
				}
			}
			return
		}
	}
	for c := range clients {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(c), 23))
			order := make([]target, len(targets))
			copy(order, targets)
			for !done.Load() {
				rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
				for _, tg := range order {
					claimOnce(c, tg)
				}
				passes[c].Add(1)
			}
		})
	}
	// The in-flight keys' workers complete them while the migration runs.
	finished := make(chan []string)
	go func() {
		var bad []string
		for !migrating.Load() {
			time.Sleep(time.Millisecond)
		}
		for _, k := range s.Keys {
			if !k.Finish {
				continue
			}
			var out string
			if err := pool.QueryRow(ctx, `SELECT idem.complete($1, $2, $3, jsonb_build_object('finished', $2::text))`, k.Source, k.Key, k.Token).Scan(&out); err != nil || out != "completed" {
				bad = append(bad, fmt.Sprintf("%s [%s]: completing with its token during the upgrade: %q %v", k.id(), k.State, out, describe(err)))
			}
		}
		finished <- bad
	}()
	waitPasses := func(n int64) {
		for c := range clients {
			for passes[c].Load() < n {
				time.Sleep(5 * time.Millisecond)
			}
		}
	}
	waitPasses(1)
	m, err := migrate.New(db, migrate.Config{})
	if err != nil {
		t.Fatal(err)
	}
	migrating.Store(true)
	start := time.Now()
	res, upErr := m.Up(ctx)
	took := time.Since(start)
	migrating.Store(false)
	for _, b := range <-finished {
		t.Error(b)
	}
	// The workers' completions woke the waiters registered at version 23.
	s.woken(t, ctx)
	// Every client claims every key at least once more on the new version.
	after := make([]int64, clients)
	for c := range clients {
		after[c] = passes[c].Load()
	}
	for c := range clients {
		for passes[c].Load() < after[c]+2 {
			time.Sleep(5 * time.Millisecond)
		}
	}
	done.Store(true)
	wg.Wait()
	if upErr != nil {
		t.Fatalf("migrate up from 23 under claims: %v", upErr)
	}
	t.Logf("%d steps up from 23 in %v; %d clients made %d claims, %d of them while the migration ran (%d retried on 40001)",
		len(res), took.Round(time.Millisecond), clients, claims.Load(), during.Load(), retried.Load())
	for _, e := range errs {
		t.Errorf("%s", e)
	}
	for _, tg := range targets {
		k := tg.k
		by := acquired[k.id()]
		switch {
		case tg.fresh || k.Outcome == "acquired":
			if len(by) != 1 {
				t.Errorf("%s [%s; %s]: acquired %d times (%s), want once", k.id(), k.State, k.Where, len(by), strings.Join(by, ", "))
			}
		case len(by) > 0:
			t.Errorf("%s [%s; %s]: answered %s at version 23, acquired by %s", k.id(), k.State, k.Where, k.Outcome, strings.Join(by, ", "))
		}
	}

	// Afterwards: a key acquired and completed answers completed with its
	// acquirer's result, an in-flight key completed by its worker with its
	// worker's, every other key as at version 23.
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	installClock(t, ctx, conn)
	got := s.answersNow(t, ctx)
	for _, k := range s.Keys {
		ans := got[k.id()]
		switch {
		case k.Outcome == "acquired" || k.Finish:
			if ans["claim.outcome"] != `"completed"` || !strings.Contains(ans["claim.result"], "by") && !strings.Contains(ans["claim.result"], "finished") {
				if k.ProbeFP == everyOtherFP && ans["claim.outcome"] == `"mismatch"` {
					continue
				}
				t.Errorf("%s [%s; %s]: after the upgrade under claims: %v, want completed with its worker's result", k.id(), k.State, k.Where, ans)
			}
		default:
			// Only the claim: the load's claims wrote what a claim writes
			// (a key at max_attempts failed for good, an adopted key
			// copied), which peek and the token's calls see.
			for _, f := range everyClaimFields {
				if w, h := s.Want[k.id()]["claim."+f], ans["claim."+f]; w != h {
					t.Errorf("%s [%s; %s]: after the upgrade under claims: claim.%s: %s at version 23, %s now", k.id(), k.State, k.Where, f, w, h)
				}
			}
		}
	}
}

// describe renders err with its SQLSTATE.
func describe(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return fmt.Sprintf("%s (SQLSTATE %s)", pe.Message, pe.Code)
	}
	return fmt.Sprint(err)
}

// TestUpgradeFromEveryStateCheckIsNotBlind: the every-state fixture's check is not
// blind. At version 26, the fixture's database is changed as a wrong
// migration could change it (a hold lost, the adoption ended, a row of the
// default partition lost, an in-flight key's token renumbered, an expiry
// recomputed from the source's ttl for a key heartbeating past it and for a
// source whose ttl was cut, a stored result lost, the waiters forgotten):
// each is reported, by key.
func TestUpgradeFromEveryStateCheckIsNotBlind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, db, p := setupAt(t)
	s := buildEveryState(t, ctx, url, p, 26)
	for _, m := range []string{
		`DELETE FROM idem.holds WHERE source = 'd30' AND key = 'held-queued'`,
		`UPDATE idem.adoptions SET state = 'done'`,
		`DELETE FROM idem.processed_events_default WHERE source = 'd400' AND key = 'completed-150d'`,
		`UPDATE idem.processed_events SET token = token + 1000000 WHERE source = 'd90' AND key = 'inflight-45d'`,
		`UPDATE idem.processed_events SET expires_at = first_seen + interval '7 days' WHERE source = 'd7' AND key = 'heartbeats-40d'`,
		`UPDATE idem.processed_events SET expires_at = first_seen + interval '7 days' WHERE source = 'ttl-cut'`,
		`UPDATE idem.processed_events SET result = NULL WHERE source = 'd400' AND key = 'completed-300d'`,
		`TRUNCATE idem.waiters`,
	} {
		if res, err := db.ExecContext(ctx, m); err != nil {
			t.Fatalf("%s: %v", m, err)
		} else if n, _ := res.RowsAffected(); n == 0 && !strings.HasPrefix(m, "TRUNCATE") {
			t.Fatalf("%s changed nothing", m)
		}
	}
	diffs, _ := s.diff(s.answersNow(t, ctx))
	for _, id := range []string{"d30/held-queued", "adopt/adopt-1-recent", "adopt/adopt-2-old-month", "d400/completed-150d",
		"d90/inflight-45d", "d7/heartbeats-40d", "ttl-cut/ttl-cut-45d", "d400/completed-300d"} {
		if !slices.ContainsFunc(diffs, func(d string) bool { return strings.HasPrefix(d, id+" ") }) {
			t.Errorf("%s was changed, and not reported", id)
		}
	}
	for _, d := range diffs {
		if !slices.ContainsFunc([]string{"d30/held-queued ", "adopt/adopt-", "d400/completed-150d ", "d90/inflight-45d ",
			"d7/heartbeats-40d ", "ttl-cut/", "d400/completed-300d "}, func(p string) bool { return strings.HasPrefix(d, p) }) {
			t.Errorf("reported, and not changed: %s", d)
		}
	}
	t.Logf("%d differences reported, e.g.\n%s", len(diffs), strings.Join(diffs[:min(len(diffs), 5)], "\n"))
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	installClock(t, ctx, conn)
	var waited int
	for _, k := range s.Keys {
		if k.Waited {
			waited++
			if _, err := conn.Exec(ctx, `SELECT idem.complete($1, $2, $3)`, k.Source, k.Key, k.Token); err != nil {
				t.Fatal(err)
			}
		}
	}
	if left := s.notWoken(ctx, 2*time.Second); len(left) != waited {
		t.Errorf("with the waiters forgotten, %d of %d waiters reported not woken: %v", len(left), waited, left)
	}
}
