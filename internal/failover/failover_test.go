// Package failover tries idem against a failover as every managed
// PostgreSQL does one: a primary and a streaming replica (both throwaway
// clusters from the local server binaries), a storm of Do calls with an
// outbound effect and of inbox deliveries from many senders, the primary
// lost (an immediate stop) at a random moment, the replica promoted, the
// application reconnecting through one multi-host connection string with
// target_session_attrs=read-write, and a new replica made from the new
// primary for the next failover. Every work execution, token and
// downstream charge is counted here, outside both servers.
//
// IDEM_FAILOVER_ROUNDS sets the failovers per replication mode (default
// 2, the CI size); docs/reliability.md ("Failover") has the full run's
// figures.
package failover

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

// EnvRounds names the variable that sets the failovers per mode.
const EnvRounds = "IDEM_FAILOVER_ROUNDS"

const (
	paySource   = "pay"
	inboxSource = "shop"
	// lease is the policy lease of both sources: a key whose holder was
	// lost with the old primary (or whose completion was) is re-acquired
	// this long after its last claim.
	lease = 4 * time.Second
	// senders deliver the events of Do; inboxSenders the inbox's.
	senders      = 16
	inboxSenders = 4
)

func rounds(t *testing.T) int {
	v := os.Getenv(EnvRounds)
	if v == "" {
		return 2
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a positive number of failovers", EnvRounds, v)
	}
	return n
}

// TestFailover runs the storm through failovers, first with a synchronous
// standby (synchronous_standby_names = '*', synchronous_commit = on): no
// work whose completion was acknowledged runs again, no token is handed
// out twice, no accepted inbox event is lost. Then with asynchronous
// replication (the default): the works that ran twice are counted (only
// those whose completion, or claim, had not reached the replica), and the
// downstream is still charged once per event, by the effect's outbound
// key.
func TestFailover(t *testing.T) {
	t.Parallel()
	n := rounds(t)
	for _, synchronous := range []bool{true, false} {
		name := map[bool]string{true: "synchronous", false: "asynchronous"}[synchronous]
		t.Run(name, func(t *testing.T) {
			t.Parallel() // each mode has servers of its own; most of a failover is waiting
			f := run(t, synchronous, n)
			t.Logf("%s: %s", name, f)
			// Whatever the mode: no token twice, every event charged once,
			// every acknowledged event completed in the end.
			if f.tokensReused != 0 {
				t.Errorf("%d tokens handed out twice: %v", f.tokensReused, f.reused)
			}
			if f.chargedTwice != 0 || f.charged != f.events {
				t.Errorf("downstream: %d events charged, %d charged more than once, %d events", f.charged, f.chargedTwice, f.events)
			}
			if f.shippedTwice != 0 || f.shipped != f.inboxAcked-f.inboxLost {
				t.Errorf("the inbox handler's write committed for %d events (%d of them more than once), %d accepted and not lost", f.shipped, f.shippedTwice, f.inboxAcked-f.inboxLost)
			}
			if f.cacheAnswers == 0 {
				t.Error("the cache answered no duplicate after the last failover: its listener did not come back on the new primary")
			}
			if f.notCompleted != 0 {
				t.Errorf("%d acknowledged events not completed on the last primary: %v", f.notCompleted, f.notCompletedKeys)
			}
			if synchronous {
				if f.ranAfterAck != 0 {
					t.Errorf("%d works ran again after their completion was acknowledged: %v", f.ranAfterAck, f.ranAfterAckKeys)
				}
				if f.inboxLost != 0 {
					t.Errorf("%d accepted inbox events lost: %v", f.inboxLost, f.inboxLostKeys)
				}
			}
		})
	}
}

// figures is what one mode's run measured.
type figures struct {
	failovers                 int
	outage                    []time.Duration // primary lost until the replica accepts writes
	events, deliveries, acked int
	runs, ranTwice            int // work executions; events whose work ran more than once
	finishedTwice             int // events whose work ran to its end more than once
	ranAfterAck               int // executions that began after a completion of the event was acknowledged
	ranAfterAckKeys           []string
	tokens, tokensReused      int
	reused                    []string
	requests, charged         int // downstream requests, events charged
	chargedTwice              int // events charged more than once (different keys)
	notCompleted              int
	notCompletedKeys          []string
	inboxEvents, inboxAcked   int
	inboxRuns, inboxRanTwice  int
	inboxLost                 int
	shipped, shippedTwice     int   // inbox events whose handler's write committed; more than once
	cacheAnswers              int64 // duplicates the cache answered after the last failover
	inboxLostKeys             []string
	elapsed                   time.Duration
}

func (f figures) String() string {
	var max time.Duration
	for _, d := range f.outage {
		max = mx(max, d)
	}
	return fmt.Sprintf("%d failovers (longest outage %v) in %v; Do: %d events, %d deliveries, %d work runs, %d events ran more than once (%d to their end), %d runs after an acknowledged completion; "+
		"downstream: %d requests, %d events charged, %d charged twice; tokens: %d, %d reused; "+
		"inbox: %d events accepted, %d handler runs, %d ran twice, %d handler writes committed (%d twice), %d accepted events lost; %d acknowledged events not completed",
		f.failovers, max.Round(time.Millisecond), f.elapsed.Round(time.Millisecond), f.events, f.deliveries, f.runs, f.ranTwice, f.finishedTwice, f.ranAfterAck,
		f.requests, f.charged, f.chargedTwice, f.tokens, f.tokensReused,
		f.inboxAcked, f.inboxRuns, f.inboxRanTwice, f.shipped, f.shippedTwice, f.inboxLost, f.notCompleted)
}

func mx(a, b time.Duration) time.Duration {
	if a > b {
		return a
	}
	return b
}

// ledger is the side store: every work execution, token and
// acknowledgement, kept in this process, outside both servers.
type ledger struct {
	mu          sync.Mutex
	runs        map[string]int  // event → work executions
	finished    map[string]int  // event → executions that ran to their end (the charge made or replayed)
	acked       map[string]bool // event → Do returned its completion
	ranAfterAck []string
	tokens      map[int64]string // token → who got it
	reused      []string
	inboxRuns   map[string]int
	inboxAcked  map[string]bool
	deliveries  int
}

func newLedger() *ledger {
	return &ledger{runs: map[string]int{}, finished: map[string]int{}, acked: map[string]bool{}, tokens: map[int64]string{},
		inboxRuns: map[string]int{}, inboxAcked: map[string]bool{}}
}

// ran records that the work of source/key began under token.
func (l *ledger) ran(source, key string, token int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	who := fmt.Sprintf("%s/%s", source, key)
	if source == inboxSource {
		l.inboxRuns[key]++
	} else {
		l.runs[key]++
		if l.acked[key] {
			l.ranAfterAck = append(l.ranAfterAck, key)
		}
	}
	who += "#" + strconv.Itoa(l.runs[key]+l.inboxRuns[key])
	if prev, ok := l.tokens[token]; ok || token == 0 {
		l.reused = append(l.reused, fmt.Sprintf("%d: %s and %s", token, prev, who))
	}
	l.tokens[token] = who
}

// downstream is a payment API that deduplicates by Idempotency-Key, as
// Stripe does: a request with a key it has seen is answered the first
// one's charge and charges nothing.
type downstream struct {
	mu       sync.Mutex
	byKey    map[string]string // outbound key → charge id
	charges  map[string]int    // event → charges made
	requests int
}

func (d *downstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	key := r.Header.Get("Idempotency-Key")
	if r.Method != http.MethodPost || key == "" {
		http.Error(w, "a charge needs POST and an Idempotency-Key", http.StatusBadRequest)
		return
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.requests++
	id, ok := d.byKey[key]
	if !ok {
		event := string(body)
		d.charges[event]++
		id = fmt.Sprintf("ch_%s_%d", event, d.charges[event])
		d.byKey[key] = id
	}
	fmt.Fprintf(w, "%q", id)
}

// servers is the primary and its replica, on two fixed ports: a new
// replica takes the lost primary's port, so the application's one
// connection string names every server of the test.
type servers struct{ primary, standby *pgcluster.Cluster }

func (s *servers) url() string {
	return fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=2",
		s.primary.Port, s.standby.Port)
}

// failover loses the primary (immediate stop: every backend quits at
// once, nothing more is sent to the replica), promotes the replica, and
// makes a new replica of it on the lost primary's port. It returns how
// long no server accepted writes.
func (s *servers) failover(ctx context.Context) (time.Duration, error) {
	lost := s.primary
	lost.Crash()
	start := time.Now()
	if err := s.standby.Promote(ctx); err != nil {
		return 0, err
	}
	outage := time.Since(start)
	s.primary = s.standby
	s.standby = nil
	standby, err := s.primary.Standby(ctx, pgcluster.OnPort(lost.Port))
	lost.Remove()
	if err != nil {
		return outage, fmt.Errorf("new replica: %w", err)
	}
	s.standby = standby
	return outage, nil
}

func (s *servers) stop() {
	if s.standby != nil {
		s.standby.Stop()
	}
	if s.primary != nil {
		s.primary.Stop()
	}
}

// run is one mode: n failovers during the storm, then every event
// delivered once more and the inbox drained; it returns the figures.
func run(t *testing.T, synchronous bool, n int) figures {
	ctx := context.Background()
	began := time.Now()
	// synchronous_commit on: the commit waits for the local flush and,
	// with synchronous_standby_names, for the standby's (pgcluster's
	// default, off, is for tests that never lose a server). A standby
	// inherits the settings, so a promoted one asks for a standby too.
	opts := []pgcluster.Option{pgcluster.Setting("synchronous_commit", "on")}
	if synchronous {
		opts = append(opts, pgcluster.Setting("synchronous_standby_names", "*"))
	}
	s := &servers{}
	var err error
	if s.primary, err = pgcluster.Start(ctx, opts...); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stop)
	if s.standby, err = s.primary.Standby(ctx); err != nil {
		t.Fatal(err)
	}
	url := s.url()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatal(err)
	}
	// The events' effects get the same lease: an effect whose claim
	// committed while its answer was lost with the primary blocks its
	// event until that lease ends (2 minutes by default).
	if _, err := db.ExecContext(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ($1, '1 day', $4::interval), ($2, '1 day', $4::interval), ($3, '1 day', $4::interval)`,
		paySource, paySource+idem.EffectsSuffix, inboxSource, fmt.Sprintf("%d milliseconds", lease.Milliseconds())); err != nil {
		t.Fatal(err)
	}
	db.Close()

	pcfg, err := pgxpool.ParseConfig(url + " pool_max_conns=48")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	// The inbox handler's business write, in the job's transaction.
	if _, err := pool.Exec(ctx, `CREATE TABLE shipments (key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	quiet := slog.New(slog.DiscardHandler)
	cacheAnswers := &cacheCounter{}
	c, err := idem.New(pool, &idem.Config{Logger: quiet, Cache: &idem.CacheConfig{}, Tracer: cacheAnswers})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)

	l := newLedger()
	down := &downstream{byKey: map[string]string{}, charges: map[string]int{}}
	api := httptest.NewServer(down)
	t.Cleanup(api.Close)
	tr, err := idemhttp.NewTransport(http.DefaultTransport, nil)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: tr, Timeout: 5 * time.Second}
	charge := func(ctx context.Context, key string) (string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, api.URL+"/v1/charges", strings.NewReader(key))
		if err != nil {
			return "", err
		}
		resp, err := hc.Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			return "", fmt.Errorf("downstream: %s: %s", resp.Status, b)
		}
		return string(b), nil
	}
	work := func(key string) func(context.Context) (any, error) {
		return func(ctx context.Context) (any, error) {
			cl, _ := idem.EventFrom(ctx)
			l.ran(paySource, key, cl.Token)
			v, err := idem.EffectValue(ctx, c, "charge", func(ctx context.Context) (string, error) { return charge(ctx, key) })
			if err == nil {
				l.mu.Lock()
				l.finished[key]++
				l.mu.Unlock()
			}
			return v, err
		}
	}

	in, err := inbox.New(inbox.Config{Pool: pool, Idem: c, Logger: quiet, RunLease: lease, DefaultMaxAttempts: 1000, RepairEvery: time.Second,
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			cl, _ := idem.EventFrom(ctx)
			l.ran(inboxSource, d.Key, cl.Token)
			_, err := tx.Exec(ctx, `INSERT INTO shipments (key) VALUES ($1)`, d.Key)
			return map[string]int{"attempt": d.Attempt}, err
		}})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := in.NewWorkerClient(8, &river.Config{Logger: quiet, RetryPolicy: fast{}, JobTimeout: 5 * time.Second,
		RescueStuckJobsAfter: 6 * time.Second, FetchPollInterval: 100 * time.Millisecond, FetchCooldown: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rc.Stop(sctx)
	})

	// The storm: each event delivered by two racing senders, each
	// retrying until it is answered (an error, in progress: again after a
	// backoff); one acknowledged event in five delivered again a moment
	// later, as senders do.
	stormCtx, stopStorm := context.WithTimeout(ctx, 10*time.Minute)
	defer stopStorm()
	deliveries := make(chan string, 64)
	var pending sync.WaitGroup // deliveries not yet answered
	var acks atomic.Int64
	deliver := func(key string) {
		defer pending.Done()
		for i := 0; ; i++ {
			var opts []idem.ClaimOption
			if i%2 == 1 {
				opts = append(opts, idem.WithWait(time.Second)) // a waiter woken by LISTEN/NOTIFY
			}
			l.mu.Lock()
			l.deliveries++
			l.mu.Unlock()
			_, err := c.Do(stormCtx, paySource, key, work(key), opts...)
			if err == nil {
				l.mu.Lock()
				l.acked[key] = true
				l.mu.Unlock()
				acks.Add(1)
				return
			}
			if stormCtx.Err() != nil {
				return
			}
			time.Sleep(time.Duration(20+rand.IntN(80)) * time.Millisecond)
		}
	}
	accept := func(key string) {
		defer pending.Done()
		for stormCtx.Err() == nil {
			if _, err := in.Accept(stormCtx, &inbox.Delivery{Source: inboxSource, Key: key, Payload: []byte(`{}`)}); err == nil {
				l.mu.Lock()
				l.inboxAcked[key] = true
				l.mu.Unlock()
				return
			}
			time.Sleep(time.Duration(20+rand.IntN(80)) * time.Millisecond)
		}
	}
	var workers sync.WaitGroup
	for range senders {
		workers.Go(func() {
			for k := range deliveries {
				if strings.HasPrefix(k, "in-") {
					accept(k)
				} else {
					deliver(k)
				}
			}
		})
	}
	var producing atomic.Bool
	producing.Store(true)
	var events, inboxEvents int
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for i := 0; producing.Load(); i++ {
			key := fmt.Sprintf("ev-%d", i)
			events++
			pending.Add(2)
			deliveries <- key
			deliveries <- key
			if i%4 == 0 {
				ik := fmt.Sprintf("in-%d", i/4)
				inboxEvents++
				pending.Add(2)
				deliveries <- ik
				deliveries <- ik
			}
			if i%5 == 0 {
				// Delivered again a moment later (after its ack, most
				// likely, perhaps across a failover).
				pending.Add(1)
				time.AfterFunc(time.Duration(rand.IntN(1500))*time.Millisecond, func() { deliveries <- key })
			}
		}
	}()

	f := figures{failovers: n}
	t.Logf("setup: %v", time.Since(began).Round(time.Millisecond))
	for r := range n {
		roundStart := time.Now()
		// Let the storm reach the current primary, then lose it at a
		// random moment.
		from := acks.Load()
		for deadline := time.Now().Add(20 * time.Second); acks.Load() < from+50 && time.Now().Before(deadline); {
			time.Sleep(10 * time.Millisecond)
		}
		time.Sleep(time.Duration(rand.IntN(400)) * time.Millisecond)
		fo := time.Now()
		outage, err := s.failover(ctx)
		t.Logf("round %d: storm on the primary %v, failover %v (outage %v)", r+1, fo.Sub(roundStart).Round(time.Millisecond), time.Since(fo).Round(time.Millisecond), outage.Round(time.Millisecond))
		if err != nil {
			producing.Store(false)
			t.Fatalf("failover %d: %v", r+1, err)
		}
		f.outage = append(f.outage, outage)
	}
	// The storm goes on a moment on the last primary, then stops; every
	// delivery is answered.
	from := acks.Load()
	for deadline := time.Now().Add(20 * time.Second); acks.Load() < from+50 && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	producing.Store(false)
	<-produced
	stormDone := time.Now()
	waitGroup(t, &pending, "the storm's deliveries")
	t.Logf("storm: %v after the last failover's start; deliveries answered %v later", stormDone.Sub(began).Round(time.Millisecond), time.Since(stormDone).Round(time.Millisecond))
	phase := time.Now()

	// Every event delivered once more: a work that runs now ran after its
	// completion was acknowledged, if it was.
	l.mu.Lock()
	keys := make([]string, 0, len(l.acked))
	for k := range l.acked {
		keys = append(keys, k)
	}
	l.mu.Unlock()
	for _, k := range keys {
		pending.Add(1)
		deliveries <- k
	}
	waitGroup(t, &pending, "the redeliveries")
	close(deliveries)
	workers.Wait()
	t.Logf("redeliveries: %v", time.Since(phase).Round(time.Millisecond))
	phase = time.Now()

	// The cache of completed outcomes answers again on the last primary:
	// its listener (LISTEN on a connection of its own, lost with each
	// primary) reconnected there. Each of up to 200 events twice in a row:
	// the second is answered by the cache.
	from = cacheAnswers.n.Load()
	for _, k := range keys[:min(len(keys), 200)] {
		for range 2 {
			if res, err := c.Do(ctx, paySource, k, work(k)); err != nil || !res.Replayed {
				t.Fatalf("a duplicate of %s after the storm: %+v %v", k, res, err)
			}
		}
	}
	f.cacheAnswers = cacheAnswers.n.Load() - from
	t.Logf("cache answers after the last failover: %d of %d duplicates", f.cacheAnswers, 2*min(len(keys), 200))

	// The inbox: every accepted event processed (its key completed), or
	// lost with the old primary.
	waitInbox(t, pool, l)
	t.Logf("inbox drained: %v", time.Since(phase).Round(time.Millisecond))

	f.elapsed = time.Since(began)
	l.mu.Lock()
	defer l.mu.Unlock()
	f.events, f.deliveries, f.acked = events, l.deliveries, len(l.acked)
	for _, n := range l.runs {
		f.runs += n
		if n > 1 {
			f.ranTwice++
		}
	}
	for _, n := range l.finished {
		if n > 1 {
			f.finishedTwice++
		}
	}
	f.ranAfterAck, f.ranAfterAckKeys = len(l.ranAfterAck), first(l.ranAfterAck)
	f.tokens, f.tokensReused, f.reused = len(l.tokens), len(l.reused), first(l.reused)
	down.mu.Lock()
	f.requests = down.requests
	for _, n := range down.charges {
		f.charged++
		if n > 1 {
			f.chargedTwice++
		}
	}
	down.mu.Unlock()
	f.notCompletedKeys = notCompleted(t, pool, paySource, keys)
	f.notCompleted = len(f.notCompletedKeys)
	f.notCompletedKeys = first(f.notCompletedKeys)
	f.inboxEvents, f.inboxAcked = inboxEvents, len(l.inboxAcked)
	for _, n := range l.inboxRuns {
		f.inboxRuns += n
		if n > 1 {
			f.inboxRanTwice++
		}
	}
	var accepted []string
	for k := range l.inboxAcked {
		accepted = append(accepted, k)
	}
	f.inboxLostKeys = notCompleted(t, pool, inboxSource, accepted)
	f.inboxLost = len(f.inboxLostKeys)
	f.inboxLostKeys = first(f.inboxLostKeys)
	if err := pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE n > 1), count(*) FROM (SELECT count(*) n FROM shipments GROUP BY key) s`).Scan(&f.shippedTwice, &f.shipped); err != nil {
		t.Fatal(err)
	}
	return f
}

// cacheCounter counts the claims Config.Cache answered.
type cacheCounter struct{ n atomic.Int64 }

func (*cacheCounter) TraceStart(ctx context.Context, _ idem.TraceStartData) context.Context {
	return ctx
}

func (c *cacheCounter) TraceEnd(_ context.Context, d idem.TraceEndData) {
	if d.Op == idem.OpCache && d.Err == nil {
		c.n.Add(1)
	}
}

// fast retries a failed inbox job after 50 ms.
type fast struct{}

func (fast) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(50 * time.Millisecond) }

func first(s []string) []string { return s[:min(len(s), 10)] }

// waitGroup waits for wg, at most two minutes.
func waitGroup(t *testing.T, wg *sync.WaitGroup, what string) {
	t.Helper()
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Minute):
		t.Fatalf("%s were not answered within two minutes", what)
	}
}

// notCompleted returns the keys of source among keys whose row on the
// primary is not completed (or is missing).
func notCompleted(t *testing.T, pool *pgxpool.Pool, source string, keys []string) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT k FROM unnest($2::text[]) k
		WHERE NOT EXISTS (SELECT FROM idem.processed_events e WHERE e.source = $1 AND e.key = k AND e.status = 'completed')
		ORDER BY k`, source, keys)
	if err != nil {
		t.Fatal(err)
	}
	missing, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return missing
}

// waitInbox waits until no inbox job is left to run and every accepted
// event that the primary knows is completed (one it does not know was
// lost with an old primary: nothing will run it), at most two minutes.
func waitInbox(t *testing.T, pool *pgxpool.Pool, l *ledger) {
	t.Helper()
	l.mu.Lock()
	var accepted []string
	for k := range l.inboxAcked {
		accepted = append(accepted, k)
	}
	l.mu.Unlock()
	var left int
	for deadline := time.Now().Add(2 * time.Minute); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		err := pool.QueryRow(context.Background(), `SELECT
			(SELECT count(*) FROM river_job WHERE state NOT IN ('completed', 'discarded', 'cancelled'))
			+ (SELECT count(*) FROM idem.processed_events e WHERE e.source = $1 AND e.key = ANY($2::text[]) AND e.status = 'processing')`,
			inboxSource, accepted).Scan(&left)
		if err == nil && left == 0 {
			return
		}
	}
	t.Fatalf("the inbox did not drain within two minutes: %d jobs or events left", left)
}
