package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

// "A year in an hour" (issue 56): idem driven through twelve simulated
// months, as operators run it, on a durable cluster of the section's own.
//
// Time is simulated by replacing idem.clock() (as the tests do) with the
// server's clock plus an offset, moved one tick (yearConfig.daysPerTick
// days) at a time. Each tick has two phases:
//
//   - claims: yearConfig.clients clients, each paced to yearConfig.rate
//     claims a second, run that tick's new keys (5 sources, ttls 7, 30,
//     60, 90 and 400 days; the 90-day source is changed to 30 days at
//     yearConfig.ttlChangeDay), duplicates of retained keys, retried
//     failures, and re-deliveries of keys a day before and a day past
//     their expiry; every yearConfig.readsEvery days, `idemctl stats`,
//     `idemctl check` and the dashboard's pages are read meanwhile;
//   - maintenance: two "hosts" each run `idemctl prune --max-duration 4m`
//     and `idemctl partitions rotate` (docs/idemctl.md's cron jobs: prune
//     every 5 minutes and rotate daily fold into one run each per tick) as
//     subprocesses, at once, while the clients re-deliver duplicates at the
//     same pace. A run is killed (SIGTERM or SIGKILL) at a random moment
//     with probability yearConfig.killProb, and the database is restarted
//     once (yearConfig.restartDay) during this phase.
//
// The schema starts at migrate.Latest()-1; at yearConfig.migrateDay
// `idemctl migrate up` upgrades it under the claims. Until then this
// idemctl refuses the schema (exit 6), so the two hosts maintain it the
// other documented way, pg_cron's: `CALL idem.prune(batch_size => 5000)`
// and `CALL idem.rotate(premake => 3, lock_wait => '2 seconds')`, each a
// psql subprocess killed at random as idemctl's runs are (the backend of a
// killed psql carries on until it next writes to it), or with the idemctl
// given as -year-previous-idemctl (an idemctl built for that version: git
// history renumbered the migrations, so none can be built from it). The
// stats and dashboard reads start with the upgrade.
//
// Checked, not assumed (each breach is a violation the section returns):
// a key's work runs at most once until its ttl has passed since the claim
// that ran it (and a key re-delivered a day before its expiry is answered
// as done); a failed key runs again; a key re-delivered a day past its
// expiry runs again. After a tick whose maintenance was killed or cut by
// the restart, whatever is left (a table in schema idem that is not an
// attached partition, by the catalog) must be reported by `idemctl check`,
// and after the next tick whose runs were not interrupted nothing may be
// left: no such table and no maintenance lock. A SIGKILLed holder's lease
// is ended by hand before the next tick (in real time the next scheduled
// run comes a day later, past any lease; the simulation compresses that
// day into a second).
//
// Nothing in it names a partition: sizes, dead tuples and strays are read
// from the catalog (pg_partition_tree), so it measures whatever layout the
// migrations create.
type yearConfig struct {
	keys           int     // new keys over the year
	days           int     // simulated days (365)
	daysPerTick    int     // simulated days per tick
	clients        int     // claiming clients
	rate           float64 // claims per second per client
	dupFrac        float64 // duplicates per new key
	failFrac       float64 // new keys whose first run fails (retryable)
	redeliverEvery int     // 1 key in N is re-delivered near and past its expiry
	killProb       float64 // per maintenance run
	migrateDay     int     // <0: start at the latest version, no upgrade
	ttlChangeDay   int
	restartDay     int // <0: none
	readsEvery     int // days between stats/check/dashboard reads
	previous       string
	seed           uint64
	log            io.Writer
}

// Flags of the year section.
var (
	yearKeys        int
	yearDays        = 365
	yearPrevious    string
	yearKillProb    = 0.08
	yearSeed        uint64
	yearRate        float64
	yearDaysPerTick = 1
	yearTable       string // the section's markdown, for the report
)

func (c *yearConfig) defaults(full bool) {
	if c.keys == 0 {
		c.keys = 150_000
		if full {
			c.keys = 100_000_000
		}
	}
	if c.days == 0 {
		c.days = 365
	}
	if c.daysPerTick == 0 {
		c.daysPerTick = 1
	}
	if c.clients == 0 {
		c.clients = 8
	}
	if c.rate == 0 {
		c.rate = 400
		if full {
			c.rate = 2000
		}
	}
	if c.dupFrac == 0 {
		c.dupFrac = 0.2
	}
	if c.failFrac == 0 {
		c.failFrac = 0.03
	}
	if c.redeliverEvery == 0 {
		c.redeliverEvery = 4
		if full {
			c.redeliverEvery = 1000
		}
	}
	if c.readsEvery == 0 {
		c.readsEvery = 7
	}
	if c.ttlChangeDay == 0 {
		c.ttlChangeDay = c.days / 2
	}
	if c.seed == 0 {
		c.seed = uint64(time.Now().UnixNano())
	}
	if c.log == nil {
		c.log = os.Stderr
	}
}

func benchYear(ctx context.Context, e *env, o options, t *table) error {
	c := yearConfig{keys: yearKeys, days: yearDays, killProb: yearKillProb, previous: yearPrevious, seed: yearSeed,
		rate: yearRate, daysPerTick: yearDaysPerTick,
		migrateDay: yearDays / 2, restartDay: yearDays * 2 / 3}
	c.defaults(o.full)
	rep, err := runYear(ctx, c)
	if rep != nil {
		yearTable = rep.markdown(c)
		fmt.Fprint(os.Stderr, yearTable)
	}
	if err != nil {
		return err
	}
	if len(rep.violations) > 0 {
		return fmt.Errorf("%d correctness violations, the first: %s", rep.totalViolations, rep.violations[0])
	}
	return nil
}

// sources: name, ttl in days.
var yearSources = []struct {
	name string
	ttl  int
}{{"forms", 7}, {"orders", 30}, {"refunds", 60}, {"payments", 90}, {"ledger", 400}}

const yearChanged = 3             // payments: 90 -> 30 days at ttlChangeDay
const yearChangedTTL = 30         // days
const yearLease = 5 * time.Minute // simulated: a tick is a day, so a lost lease is over by the next

// keyState is what the section knows of one tracked key.
type keyState struct {
	claimAt uint32 // simulated seconds from the start, +1, when the claim that ran it started (0: never ran)
	ttl     uint16 // days, the source's ttl at that claim
}

// yearMonth is one simulated month's figures.
type yearMonth struct {
	label                     string
	newKeys, claims           int64
	all, idleDup, maint       hist
	maintTime                 time.Duration
	removed                   int64
	walMaint, walClaimsPerOp  float64
	tableBytes, indexBytes    int64
	liveRows, deadRows        int64
	statsTimes, pageTimes     []time.Duration
	events                    []string
	violations                int
	claimErrs                 int64
	maintClaims, maintWindows int64
}

type yearReport struct {
	started         time.Time
	took            time.Duration
	months          []*yearMonth
	violations      []string
	totalViolations int
	kills           map[string]int
	notes           []string
	late            int64 // re-deliveries past expiry answered as done
	runs            map[string]int
}

// violate records a breach of the correctness target.
func (y *year) violate(format string, a ...any) {
	y.vmu.Lock()
	defer y.vmu.Unlock()
	r := y.rep
	r.totalViolations++
	y.month.violations++
	v := y.month.label + ": " + fmt.Sprintf(format, a...)
	if len(r.violations) < 20 {
		r.violations = append(r.violations, v)
	}
	fmt.Fprintf(y.c.log, "bench: year: VIOLATION %s\n", v)
}

// event notes what happened in the month.
func (y *year) event(format string, a ...any) {
	y.vmu.Lock()
	defer y.vmu.Unlock()
	y.month.events = append(y.month.events, fmt.Sprintf(format, a...))
}

// year is the state of one run.
type year struct {
	c        yearConfig
	cl       *pgcluster.Cluster
	url      string
	pool     *pgxpool.Pool
	client   *idem.Client
	bin      string // this idemctl
	prev     string // an idemctl of the previous version ("": psql and the SQL procedures; "-": no maintenance)
	psql     string
	version  atomic.Int64
	offset   atomic.Int64 // simulated - real, nanoseconds
	start    time.Time    // simulated start
	rnd      *rand.Rand
	mu       sync.Mutex
	keys     []keyState // by id / trackEvery... (every key at default size)
	expiring map[int][]int32
	recent   []int32
	pending  []int32 // keys whose run was cut (error): delivered again next tick
	ttl      [5]atomic.Int32
	rep      *yearReport
	month    *yearMonth
	vmu      sync.Mutex // violations and events
	// killedPIDs are the maintenance runs killed, by pid, with the signal.
	// A SIGKILLed run's lease is ended before the next scheduled runs: in
	// real time they come hours later (a day for rotate), past any lease.
	// It is done then, not at the kill: the server may still be carrying
	// out a try_lock the killed process sent.
	killedPIDs map[int]syscall.Signal
	// killedPSQL: a psql CALL was killed (or failed). Its backend carries the
	// procedure on until it next writes to the client, then exits with the
	// lock it took held for its lease; that lease too is ended before the
	// next scheduled runs, once its backend is gone.
	killedPSQL bool
	dupWAL     float64 // WAL bytes a duplicate claim writes, measured each month
}

func runYear(ctx context.Context, c yearConfig) (*yearReport, error) {
	y := &year{c: c, rnd: rand.New(rand.NewPCG(c.seed, 56)), expiring: map[int][]int32{}, killedPIDs: map[int]syscall.Signal{},
		rep: &yearReport{started: time.Now(), kills: map[string]int{}, runs: map[string]int{}}}
	for i, s := range yearSources {
		y.ttl[i].Store(int32(s.ttl))
	}
	logf := func(format string, a ...any) { fmt.Fprintf(c.log, "bench: year: "+format+"\n", a...) }
	logf("seed %d, %d keys over %d days, %d per tick", c.seed, c.keys, c.days, c.daysPerTick)

	tmp, err := os.MkdirTemp("", "idem-year-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	y.bin = filepath.Join(tmp, "idemctl")
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", y.bin, "github.com/idemkit/idem/cmd/idemctl").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("build idemctl: %v\n%s", err, out)
	}
	from := migrate.Latest()
	if c.migrateDay >= 0 {
		from = migrate.Latest() - 1
		y.prev = c.previous
	}

	y.cl, err = pgcluster.Start(ctx, pgcluster.Durable())
	if err != nil {
		return nil, fmt.Errorf("start a durable cluster: %w", err)
	}
	defer y.cl.Stop()
	y.url = y.cl.URL("postgres")
	y.psql = filepath.Join(y.cl.BinDir, "psql")
	cfg, err := pgx.ParseConfig(y.url)
	if err != nil {
		return nil, err
	}
	db := stdlib.OpenDB(*cfg)
	err = upTo(ctx, db, from)
	db.Close()
	if err != nil {
		return nil, fmt.Errorf("migrate to %d: %w", from, err)
	}
	y.version.Store(from)
	pcfg, err := pgxpool.ParseConfig(y.url)
	if err != nil {
		return nil, err
	}
	pcfg.MaxConns = int32(c.clients + 6)
	if y.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err != nil {
		return nil, err
	}
	defer y.pool.Close()
	for _, s := range yearSources {
		if _, err := y.pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ($1, make_interval(days => $2), $3::interval)`,
			s.name, s.ttl, fmt.Sprintf("%d seconds", int(yearLease.Seconds()))); err != nil {
			return nil, err
		}
	}
	if y.client, err = idem.New(y.pool, &idem.Config{RecordTimeout: 30 * time.Second}); err != nil {
		return nil, err
	}
	now := time.Now().UTC()
	y.start = time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)
	y.keys = make([]keyState, c.keys)

	err = y.loop(ctx, logf)
	y.rep.took = time.Since(y.rep.started)
	return y.rep, err
}

// setClock moves idem.clock() to simulated time at.
func (y *year) setClock(ctx context.Context, at time.Time) error {
	off := time.Until(at)
	if _, err := y.pool.Exec(ctx, fmt.Sprintf(`CREATE OR REPLACE FUNCTION idem.clock() RETURNS timestamptz
		LANGUAGE sql VOLATILE PARALLEL SAFE
		AS $$ SELECT pg_catalog.clock_timestamp() + interval '%d microseconds' $$`, off.Microseconds())); err != nil {
		return fmt.Errorf("move idem.clock(): %w", err)
	}
	y.offset.Store(int64(off))
	return nil
}

func (y *year) simNow() time.Time { return time.Now().Add(time.Duration(y.offset.Load())) }

// idemctl is the binary for the schema's version now ("" when none: the
// SQL procedures maintain it).
func (y *year) idemctl() string {
	if y.version.Load() >= migrate.Latest() {
		return y.bin
	}
	if y.prev == "-" {
		return ""
	}
	return y.prev
}

// jobCmd is one host's maintenance run: idemctl's, or pg_cron's CALL
// through psql before the upgrade.
func (y *year) jobCmd(ctx context.Context, job string) *exec.Cmd {
	if bin := y.idemctl(); bin != "" {
		args := map[string][]string{"prune": {"prune", "--max-duration", "4m"}, "rotate": {"partitions", "rotate"}}[job]
		return exec.CommandContext(ctx, bin, append(args, "--database-url", y.url, "--log-format", "json")...)
	}
	call := map[string]string{"prune": "CALL idem.prune(batch_size => 5000)", "rotate": "CALL idem.rotate(premake => 3, lock_wait => '2 seconds')"}[job]
	return exec.CommandContext(ctx, y.psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", y.url, "-c", call)
}

func (y *year) loop(ctx context.Context, logf func(string, ...any)) error {
	c := y.c
	perDay := float64(c.keys) / float64(c.days)
	next := 0
	faulted := false // a maintenance run was killed or cut since the last clean tick
	var monthStart time.Time
	for day := 0; day < c.days; day += c.daysPerTick {
		if err := ctx.Err(); err != nil {
			return err
		}
		at := y.start.AddDate(0, 0, day)
		if y.month == nil || at.Month() != monthStart.Month() {
			if y.month != nil {
				if err := y.closeMonth(ctx); err != nil {
					return err
				}
				logf("%s: %d new keys, %d claims, %d violations so far", y.month.label, y.month.newKeys, y.month.claims, y.rep.totalViolations)
			}
			monthStart = time.Date(at.Year(), at.Month(), 1, 0, 0, 0, 0, time.UTC)
			y.month = &yearMonth{label: at.Format("2006-01")}
			y.rep.months = append(y.rep.months, y.month)
			if err := y.setClock(ctx, at); err != nil {
				return err
			}
			if err := y.calibrate(ctx); err != nil {
				return err
			}
		}
		if err := y.setClock(ctx, at); err != nil {
			return err
		}
		if day <= c.ttlChangeDay && c.ttlChangeDay < day+c.daysPerTick {
			if _, err := y.pool.Exec(ctx, `UPDATE idem.policies SET ttl = make_interval(days => $2), updated_at = now() WHERE source = $1`,
				yearSources[yearChanged].name, yearChangedTTL); err != nil {
				return err
			}
			y.ttl[yearChanged].Store(yearChangedTTL)
			y.event("%s ttl %dd→%dd", yearSources[yearChanged].name, yearSources[yearChanged].ttl, yearChangedTTL)
		}

		// Phase 1: claims (and, when due, the upgrade and the reads).
		n := int(perDay*float64(day+c.daysPerTick)) - int(perDay*float64(day))
		n = min(n, c.keys-next)
		work := y.claimsFor(day, next, n)
		next += n
		var side sync.WaitGroup
		var sideErr error
		var sideMu sync.Mutex
		if c.migrateDay >= 0 && day <= c.migrateDay && c.migrateDay < day+c.daysPerTick {
			side.Add(1)
			go func() {
				defer side.Done()
				t0 := time.Now()
				out, err := exec.CommandContext(ctx, y.bin, "migrate", "up", "--database-url", y.url, "--river=false").CombinedOutput()
				if err != nil {
					sideMu.Lock()
					sideErr = fmt.Errorf("idemctl migrate up: %v\n%s", err, out)
					sideMu.Unlock()
					return
				}
				y.version.Store(migrate.Latest())
				y.event("migrate up %d→%d under claims (%s)", migrate.Latest()-1, migrate.Latest(), time.Since(t0).Round(time.Millisecond))
			}()
		}
		if day/c.readsEvery != (day+c.daysPerTick)/c.readsEvery || day == 0 {
			side.Add(1)
			go func() {
				defer side.Done()
				if err := y.reads(ctx); err != nil {
					sideMu.Lock()
					sideErr = err
					sideMu.Unlock()
				}
			}()
		}
		y.run(ctx, work, &y.month.idleDup, nil)
		side.Wait()
		if sideErr != nil {
			return sideErr
		}
		if c.migrateDay >= 0 && day <= c.migrateDay && c.migrateDay < day+c.daysPerTick {
			// The upgrade may have replaced idem.clock(): the simulated one again.
			if err := y.setClock(ctx, y.simNow()); err != nil {
				return err
			}
		}

		// Phase 2: maintenance from two hosts, duplicates meanwhile.
		restart := c.restartDay >= 0 && day <= c.restartDay && c.restartDay < day+c.daysPerTick
		killed, err := y.maintenance(ctx, restart)
		if err != nil {
			return err
		}
		if killed || restart {
			faulted = true
			if err := y.afterFault(ctx); err != nil {
				return err
			}
		} else if faulted {
			faulted = false
			if err := y.checkClean(ctx, "after the next scheduled runs"); err != nil {
				return err
			}
		}
	}
	if y.month != nil {
		if err := y.closeMonth(ctx); err != nil {
			return err
		}
	}
	// The last scheduled runs, killed at random as every run is: as in
	// the loop, what a kill left is checked after runs that were not
	// interrupted (before, a run of these SIGKILLed was checked against).
	for try := 0; faulted; try++ {
		if try == 10 {
			return errors.New("ten rounds of maintenance after the last tick were all interrupted")
		}
		killed, err := y.maintenance(ctx, false)
		if err != nil {
			return err
		}
		if faulted = killed; faulted {
			if err := y.afterFault(ctx); err != nil {
				return err
			}
		} else if err := y.checkClean(ctx, "after the last scheduled runs"); err != nil {
			return err
		}
	}
	return nil
}

// item is one delivery of a tick.
type item struct {
	id   int32
	kind byte // 'n' new, 'd' duplicate, 'e' a day before expiry, 'x' a day past expiry, 'p' pending
	fail bool
	seen uint32 // 'x': the key's keyState.claimAt when it was scheduled
}

func (y *year) claimsFor(day, next, n int) []item {
	y.mu.Lock()
	defer y.mu.Unlock()
	var work []item
	for i := range n {
		work = append(work, item{id: int32(next + i), kind: 'n', fail: y.rnd.Float64() < y.c.failFrac})
	}
	for range int(float64(n) * y.c.dupFrac) {
		if len(y.recent) > 0 {
			work = append(work, item{id: y.recent[y.rnd.IntN(len(y.recent))], kind: 'd'})
		}
	}
	for _, id := range y.pending {
		work = append(work, item{id: id, kind: 'p'})
	}
	y.pending = y.pending[:0]
	// Expiry buckets are days from the start of the key's lower expiry
	// bound: a day or more ahead of this tick (answered as done), or a day
	// or more past it (runs again).
	// A key that ran again since (a duplicate past its expiry) is in the
	// bucket of its new expiry; the old entry is passed over.
	for d := day + 1; d < day+1+y.c.daysPerTick; d++ {
		for _, id := range y.expiring[d] {
			if y.expiryDay(id) == d {
				work = append(work, item{id: id, kind: 'e'})
			}
		}
	}
	for d := day - 1 - y.c.daysPerTick; d < day-1; d++ {
		for _, id := range y.expiring[d] {
			if y.expiryDay(id) == d {
				work = append(work, item{id: id, kind: 'x', seen: y.keys[id].claimAt})
			}
		}
		delete(y.expiring, d)
	}
	y.rnd.Shuffle(len(work), func(i, j int) { work[i], work[j] = work[j], work[i] })
	return work
}

// run delivers work from the clients, paced, recording each claim in h
// (and every claim of the month). With more != nil, the clients go on
// re-delivering duplicates until more is closed.
func (y *year) run(ctx context.Context, work []item, h *hist, more <-chan struct{}) {
	var wg sync.WaitGroup
	var pos atomic.Int64
	var latMu sync.Mutex
	interval := time.Duration(float64(time.Second) / y.c.rate)
	for cl := range y.c.clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(y.c.seed, uint64(cl)+uint64(pos.Load())*7919))
			tick := time.NewTicker(interval)
			defer tick.Stop()
			for {
				var it item
				if i := pos.Add(1) - 1; i < int64(len(work)) {
					it = work[i]
				} else if more != nil {
					select {
					case <-more:
						return
					default:
					}
					y.mu.Lock()
					if len(y.recent) == 0 {
						y.mu.Unlock()
						return
					}
					it = item{id: y.recent[rnd.IntN(len(y.recent))], kind: 'd'}
					y.mu.Unlock()
				} else {
					return
				}
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				d := y.deliver(ctx, it)
				latMu.Lock()
				h.add(d)
				y.month.all.add(d)
				y.month.claims++
				if more != nil {
					y.month.maintClaims++
				}
				latMu.Unlock()
			}
		}()
	}
	wg.Wait()
}

// expiryDay is the day (from the start) of the tracked key's earliest
// expiry: the claim that ran it plus the ttl then. Called with y.mu held.
func (y *year) expiryDay(id int32) int {
	st := y.keys[id]
	return int((time.Duration(st.claimAt-1)*time.Second + time.Duration(st.ttl)*24*time.Hour) / (24 * time.Hour))
}

func (y *year) keyName(id int32) (source string, key string) {
	return yearSources[int(id)%len(yearSources)].name, "k" + strconv.Itoa(int(id))
}

// deliver runs one delivery through Do, retrying what the restart cut, and
// checks its answer against what the section knows of the key. It returns
// the latency of the first claim.
func (y *year) deliver(ctx context.Context, it item) time.Duration {
	src, key := y.keyName(it.id)
	si := int(it.id) % len(yearSources)
	var first time.Duration
	for attempt := 0; ; attempt++ {
		claimAt := y.simNow()
		ttl := y.ttl[si].Load()
		ran := false
		t0 := time.Now()
		res, err := y.client.Do(ctx, src, key, func(context.Context) (any, error) {
			ran = true
			y.mu.Lock()
			st := y.keys[it.id]
			y.mu.Unlock()
			if prev := y.start.Add(time.Duration(st.claimAt-1) * time.Second); st.claimAt > 0 && claimAt.Before(prev.AddDate(0, 0, int(st.ttl))) {
				y.violate("%s/%s (%c) ran again at %s, before its ttl of %d days from %s ended",
					src, key, it.kind, claimAt.Format(time.RFC3339), st.ttl, prev.Format(time.RFC3339))
			}
			if it.fail && attempt == 0 {
				return nil, errors.New("the business call failed")
			}
			return map[string]int32{"id": it.id}, nil
		}, idem.WithFingerprint(""))
		if attempt == 0 {
			first = time.Since(t0)
		}
		switch {
		case err == nil && ran:
			y.mu.Lock()
			y.keys[it.id] = keyState{claimAt: uint32(claimAt.Sub(y.start)/time.Second) + 1, ttl: uint16(ttl)}
			if int(it.id)%y.c.redeliverEvery == 0 {
				d := y.expiryDay(it.id)
				y.expiring[d] = append(y.expiring[d], it.id)
			}
			if len(y.recent) < 4096 {
				y.recent = append(y.recent, it.id)
			} else {
				y.recent[y.rnd.IntN(len(y.recent))] = it.id
			}
			if it.kind == 'n' {
				y.month.newKeys++
			}
			y.mu.Unlock()
			return first
		case err == nil && res.Replayed:
			switch it.kind {
			case 'n':
				y.mu.Lock()
				known := y.keys[it.id].claimAt > 0
				y.mu.Unlock()
				if !known {
					y.violate("%s/%s: a new key answered as done", src, key)
				}
			case 'x':
				// Unless a duplicate delivered meanwhile ran it again.
				y.mu.Lock()
				late := y.keys[it.id].claimAt == it.seen
				if late {
					y.rep.late++
				}
				y.mu.Unlock()
				if late {
					y.violate("%s/%s answered as done a day past its ttl", src, key)
				}
			}
			return first
		case ran && it.fail && attempt == 0:
			continue // the failure was recorded: delivered again, it must run
		case errors.Is(err, idem.ErrInProgress):
			// A run cut by the restart: its lease ends within the tick's
			// simulated day; delivered again next tick.
			y.mu.Lock()
			y.pending = append(y.pending, it.id)
			y.mu.Unlock()
			return first
		case err != nil && attempt < 100 && ctx.Err() == nil:
			y.mu.Lock()
			y.month.claimErrs++
			y.mu.Unlock()
			time.Sleep(100 * time.Millisecond)
			continue
		default:
			y.violate("%s/%s (%c): %v", src, key, it.kind, err)
			return first
		}
	}
}

// maintenance is phase 2: both hosts' prune and rotate at once, killed at
// random, the clients re-delivering duplicates meanwhile; with restart,
// the database is restarted while they run. It reports whether a run was
// killed.
func (y *year) maintenance(ctx context.Context, restart bool) (killed bool, err error) {
	if y.prev == "-" && y.idemctl() == "" {
		return false, nil
	}
	y.mu.Lock()
	var pids []string
	for pid, sig := range y.killedPIDs {
		if sig == syscall.SIGKILL {
			pids = append(pids, strconv.Itoa(pid))
		}
	}
	psqlKilled := y.killedPSQL
	y.mu.Unlock()
	if len(pids) > 0 || psqlKilled {
		if err := y.waitOrphans(ctx); err != nil {
			return false, err
		}
	}
	if len(pids) > 0 {
		if _, err := y.pool.Exec(ctx, `UPDATE idem.maintenance_locks SET expires_at = clock_timestamp()
			WHERE expires_at > clock_timestamp() AND holder LIKE 'idemctl@%' AND substring(holder from ':(\d+):[0-9a-f]+$') = ANY($1)`, pids); err != nil {
			return false, err
		}
	}
	if psqlKilled {
		if _, err := y.pool.Exec(ctx, `UPDATE idem.maintenance_locks SET expires_at = clock_timestamp()
			WHERE expires_at > clock_timestamp() AND holder LIKE 'sql:%'
			  AND substring(holder from '^sql:(\d+):')::int NOT IN (SELECT pid FROM pg_stat_activity)`); err != nil {
			return false, err
		}
	}
	var before, after int64
	var lsn0, lsn1 string
	q := `SELECT count(*) FROM idem.processed_events WHERE expires_at <= idem.clock()`
	if err := y.pool.QueryRow(ctx, q).Scan(&before); err != nil {
		return false, err
	}
	if err := y.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn0); err != nil {
		return false, err
	}
	claims0 := y.month.maintClaims
	done := make(chan struct{})
	claimsDone := make(chan struct{})
	go func() { y.run(ctx, nil, &y.month.maint, done); close(claimsDone) }()
	t0 := time.Now()
	var wg sync.WaitGroup
	var mu sync.Mutex
	var runErr error
	for host := range 2 {
		for _, job := range []string{"prune", "rotate"} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				k, err := y.runJob(ctx, host, job)
				mu.Lock()
				defer mu.Unlock()
				killed = killed || k
				if err != nil && runErr == nil {
					runErr = err
				}
			}()
		}
	}
	if restart {
		y.mu.Lock()
		pause := time.Duration(50+y.rnd.IntN(200)) * time.Millisecond
		y.mu.Unlock()
		time.Sleep(pause)
		if err := y.cl.Restart(ctx); err != nil {
			return false, fmt.Errorf("restart the database: %w", err)
		}
		y.event("database restarted during maintenance")
	}
	wg.Wait()
	took := time.Since(t0)
	close(done)
	<-claimsDone
	if runErr != nil && !restart {
		return killed, runErr
	}
	if err := y.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn1); err != nil {
		return killed, err
	}
	if err := y.pool.QueryRow(ctx, q).Scan(&after); err != nil {
		return killed, err
	}
	var wal float64
	if err := y.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)`, lsn1, lsn0).Scan(&wal); err != nil {
		return killed, err
	}
	y.month.maintTime += took
	y.month.removed += max(before-after, 0)
	y.month.walMaint += max(wal-float64(y.month.maintClaims-claims0)*y.dupWAL, 0)
	y.month.maintWindows++
	return killed, nil
}

// waitOrphans waits (up to a minute) until no backend of idemctl or psql
// is left. A killed run's backend carries on with what the run sent (a
// try_lock, a step, a CALL) until it next reads from its closed socket: a
// try_lock that commits after the killed holder's lease was ended takes the
// lock again, for a whole lease, and every next run is skipped. Between two
// ticks every maintenance process has exited (the reads and the upgrade
// are waited for before maintenance), so the backends left are killed
// runs'. Before, the last scheduled runs, which come right after the last
// tick's, sometimes met a SIGKILLed rotate's lock taken after its lease was
// ended (TestYearSmall, 2 runs in 8).
func (y *year) waitOrphans(ctx context.Context) error {
	deadline := time.Now().Add(time.Minute)
	for {
		var n int
		if err := y.pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name IN ('idemctl', 'psql') AND datname = current_database()`).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			y.event("%d backends of killed runs still running after a minute", n)
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// runJob runs one idemctl maintenance command as host, killing it at a
// random moment with probability killProb. A run that fails other than by
// the kill (or a restart) is an error of the section.
func (y *year) runJob(ctx context.Context, host int, job string) (killed bool, err error) {
	cmd := y.jobCmd(ctx, job)
	name := filepath.Base(cmd.Path) + " " + job
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		return false, err
	}
	y.mu.Lock()
	kill := y.rnd.Float64() < y.c.killProb
	sig := syscall.SIGTERM
	if y.rnd.IntN(2) == 0 {
		sig = syscall.SIGKILL
	}
	delay := time.Duration(y.rnd.IntN(400)) * time.Millisecond
	y.mu.Unlock()
	var fired atomic.Bool
	if kill {
		timer := time.AfterFunc(delay, func() {
			fired.Store(true)
			_ = cmd.Process.Signal(sig)
		})
		defer timer.Stop()
	}
	err = cmd.Wait()
	y.mu.Lock()
	y.rep.runs[name]++
	y.mu.Unlock()
	if fired.Load() {
		y.mu.Lock()
		y.rep.kills[fmt.Sprintf("%s %s", name, map[syscall.Signal]string{syscall.SIGTERM: "SIGTERM", syscall.SIGKILL: "SIGKILL"}[sig])]++
		y.mu.Unlock()
		y.mu.Lock()
		y.killedPIDs[cmd.Process.Pid] = sig
		if filepath.Base(cmd.Path) == "psql" {
			y.killedPSQL = true
		}
		y.mu.Unlock()
		return true, nil
	}
	if err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) || (filepath.Base(cmd.Path) != "psql" && (ee.ExitCode() == 2 || ee.ExitCode() == 6)) {
			return true, fmt.Errorf("host %d: %s: %v\n%s", host, strings.Join(cmd.Args, " "), err, out.String())
		}
		// Exit 1 (a rotation left incomplete behind a lock, a batch that
		// kept timing out, the restart), 3 (the restart) or 4 (prune lost
		// its lease): an outcome operators meet, left for the next run.
		// A psql CALL that failed keeps the lock its procedure took for
		// that lease, as a killed one does (idem.prune cannot release it
		// once it has failed): ended before the next scheduled runs, which
		// in real time come past it.
		y.mu.Lock()
		if filepath.Base(cmd.Path) == "psql" {
			y.killedPSQL = true
		}
		y.rep.runs[fmt.Sprintf("%s exit %d", name, ee.ExitCode())]++
		if len(y.rep.notes) < 5 {
			y.rep.notes = append(y.rep.notes, fmt.Sprintf("%s: %s exit %d: %s", y.month.label, name, ee.ExitCode(), lastLine(out.String())))
		}
		y.mu.Unlock()
		return true, nil
	}
	return false, nil
}

// calibrate measures the WAL a duplicate claim writes (its sampled
// counting), to take the duplicates' share out of the maintenance
// window's WAL.
func (y *year) calibrate(ctx context.Context) error {
	y.mu.Lock()
	var work []item
	for range 200 {
		if len(y.recent) > 0 {
			work = append(work, item{id: y.recent[y.rnd.IntN(len(y.recent))], kind: 'd'})
		}
	}
	y.mu.Unlock()
	if len(work) == 0 {
		return nil
	}
	var lsn0, lsn1 string
	if err := y.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn0); err != nil {
		return err
	}
	y.run(ctx, work, &y.month.idleDup, nil)
	if err := y.pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn1); err != nil {
		return err
	}
	var wal float64
	if err := y.pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)`, lsn1, lsn0).Scan(&wal); err != nil {
		return err
	}
	y.dupWAL = wal / float64(len(work))
	return nil
}

// strays are the tables in schema idem named like idem's that are not
// attached partitions of processed_events, and the maintenance locks held.
func (y *year) strays(ctx context.Context) (tables []string, locks []string, err error) {
	rows, err := y.pool.Query(ctx, `
		SELECT c.oid::regclass::text FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		 WHERE n.nspname = 'idem' AND c.relkind IN ('r', 'p') AND c.relname LIKE 'processed_events%'
		   AND c.oid <> 'idem.processed_events'::regclass
		   AND c.oid NOT IN (SELECT relid FROM pg_partition_tree('idem.processed_events'))
		 ORDER BY 1`)
	if err != nil {
		return nil, nil, err
	}
	if tables, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		return nil, nil, err
	}
	rows, err = y.pool.Query(ctx, `SELECT name || ' held by ' || holder || ' until ' || expires_at FROM idem.maintenance_locks ORDER BY name`)
	if err != nil {
		return nil, nil, err
	}
	locks, err = pgx.CollectRows(rows, pgx.RowTo[string])
	return tables, locks, err
}

// afterFault: what a kill or the restart left must be what idemctl check
// reports until the next scheduled run.
func (y *year) afterFault(ctx context.Context) error {
	tables, _, err := y.strays(ctx)
	if err != nil || len(tables) == 0 {
		return err
	}
	bin := y.idemctl()
	if bin == "" {
		// Before the upgrade this idemctl refuses the schema; what is left
		// is checked after the next uninterrupted runs all the same.
		y.event("left before the upgrade (not checked by idemctl): %v", tables)
		return nil
	}
	out, cerr := exec.CommandContext(ctx, bin, "check", "--database-url", y.url).CombinedOutput()
	var ee *exec.ExitError
	if !errors.As(cerr, &ee) {
		y.violate("idemctl check says healthy with %v left by a killed run: %s", tables, out)
		return nil
	}
	for _, tbl := range tables {
		if !bytes.Contains(out, []byte(strings.TrimPrefix(tbl, "idem."))) {
			y.violate("idemctl check does not name %s, left by a killed run: %s", tbl, out)
		}
	}
	y.event("check reported %v", tables)
	return nil
}

// checkClean: after scheduled runs that were not interrupted, nothing a
// killed run left remains.
func (y *year) checkClean(ctx context.Context, when string) error {
	tables, locks, err := y.strays(ctx)
	if err != nil {
		return err
	}
	if len(tables) > 0 {
		y.violate("%s: %v still in schema idem, not attached", when, tables)
	}
	if len(locks) > 0 {
		y.mu.Lock()
		var killed []string
		for pid, sig := range y.killedPIDs {
			for _, l := range locks {
				if strings.Contains(l, ":"+strconv.Itoa(pid)+":") {
					killed = append(killed, fmt.Sprintf("pid %d was sent %v", pid, sig))
				}
			}
		}
		y.mu.Unlock()
		y.violate("%s: maintenance locks still held: %v %v", when, locks, killed)
	}
	return nil
}

// reads: idemctl stats, idemctl check and the dashboard's pages, timed.
func (y *year) reads(ctx context.Context) error {
	bin := y.idemctl()
	if bin == "" {
		return nil
	}
	t0 := time.Now()
	if out, err := exec.CommandContext(ctx, bin, "stats", "--database-url", y.url).CombinedOutput(); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("idemctl stats: %v\n%s", err, out)
	}
	stats := time.Since(t0)
	// check's verdict is not the section's (expired rows may wait for
	// prune); it must answer.
	if out, err := exec.CommandContext(ctx, bin, "check", "--database-url", y.url).CombinedOutput(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) || (ee.ExitCode() != 5 && ee.ExitCode() != 7) {
			return fmt.Errorf("idemctl check: %v\n%s", err, out)
		}
	}
	var pages time.Duration
	if y.version.Load() >= migrate.Latest() {
		if _, err := y.pool.Exec(ctx, `SELECT idem.snapshot_stats()`); err != nil {
			return err
		}
		d, err := dashboard.New(dashboard.Config{Pool: y.pool})
		if err != nil {
			return err
		}
		for _, p := range []string{"/", "/keys?source=" + yearSources[0].name, "/keys?status=stuck", "/maintenance"} {
			req := httptest.NewRequestWithContext(ctx, http.MethodGet, p, nil)
			rec := httptest.NewRecorder()
			s := time.Now()
			d.ServeHTTP(rec, req)
			if rec.Code != http.StatusOK {
				return fmt.Errorf("dashboard %s: %d %s", p, rec.Code, rec.Body.String())
			}
			pages = max(pages, time.Since(s))
		}
	}
	y.mu.Lock()
	y.month.statsTimes = append(y.month.statsTimes, stats)
	if pages > 0 {
		y.month.pageTimes = append(y.month.pageTimes, pages)
	}
	y.mu.Unlock()
	return nil
}

// closeMonth reads the month's sizes from the catalog.
func (y *year) closeMonth(ctx context.Context) error {
	m := y.month
	return y.pool.QueryRow(ctx, `
		SELECT coalesce(sum(pg_total_relation_size(p.relid)), 0)::bigint, coalesce(sum(pg_indexes_size(p.relid)), 0)::bigint,
		       coalesce(sum(s.n_live_tup), 0)::bigint, coalesce(sum(s.n_dead_tup), 0)::bigint
		  FROM pg_partition_tree('idem.processed_events') p
		  LEFT JOIN pg_stat_user_tables s ON s.relid = p.relid
		 WHERE p.isleaf`).Scan(&m.tableBytes, &m.indexBytes, &m.liveRows, &m.deadRows)
}

func (r *yearReport) markdown(c yearConfig) string {
	var w strings.Builder
	fmt.Fprintf(&w, "### A year in an hour: %d simulated days, %s new keys, %d clients at %.0f claims/s each, durable server (took %s, seed %d)\n\n",
		c.days, fmtCount(c.keys), c.clients, c.rate, r.took.Round(time.Second), c.seed)
	fmt.Fprintf(&w, "| month | new keys | claims | claim p50 / p99 / max (ms) | during maintenance p50 / p99 / max (ms) | idle p99 (ms) | maintenance time | expired rows removed | µs / row | WAL B / row | table + indexes (MB) | indexes (MB) | live / dead tuples | stats (ms) | slowest page (ms) | events |\n")
	fmt.Fprintf(&w, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	ms := func(d time.Duration) string { return fmt.Sprintf("%.1f", float64(d.Microseconds())/1000) }
	for _, m := range r.months {
		per, wal := "-", "-"
		if m.removed > 0 {
			per = fmt.Sprintf("%.1f", float64(m.maintTime.Microseconds())/float64(m.removed))
			wal = fmt.Sprintf("%.0f", m.walMaint/float64(m.removed))
		}
		ev := strings.Join(m.events, "; ")
		if m.violations > 0 {
			ev += fmt.Sprintf(" **%d violations**", m.violations)
		}
		if m.claimErrs > 0 {
			ev += fmt.Sprintf(" (%d claim errors retried)", m.claimErrs)
		}
		fmt.Fprintf(&w, "| %s | %d | %d | %s / %s / %s | %s / %s / %s | %s | %s | %d | %s | %s | %.1f | %.1f | %d / %d | %s | %s | %s |\n",
			m.label, m.newKeys, m.claims, ms(m.all.pct(0.5)), ms(m.all.pct(0.99)), ms(m.all.max),
			ms(m.maint.pct(0.5)), ms(m.maint.pct(0.99)), ms(m.maint.max), ms(m.idleDup.pct(0.99)),
			m.maintTime.Round(time.Millisecond), m.removed, per, wal,
			float64(m.tableBytes)/1e6, float64(m.indexBytes)/1e6, m.liveRows, m.deadRows,
			msList(m.statsTimes), msList(m.pageTimes), ev)
	}
	var kills []string
	for k, n := range r.kills {
		kills = append(kills, fmt.Sprintf("%s ×%d", k, n))
	}
	slices.Sort(kills)
	var runs []string
	for k, n := range r.runs {
		runs = append(runs, fmt.Sprintf("%s ×%d", k, n))
	}
	slices.Sort(runs)
	fmt.Fprintf(&w, "\nMaintenance runs: %s; killed: %s. Re-deliveries a day past expiry answered as done: %d. Correctness violations: %d",
		strings.Join(runs, ", "), strings.Join(kills, ", "), r.late, r.totalViolations)
	for _, v := range r.violations {
		fmt.Fprintf(&w, "\n- %s", v)
	}
	if len(r.notes) > 0 {
		fmt.Fprintf(&w, "\n\nRuns that failed (left for the next run):")
		for _, n := range r.notes {
			fmt.Fprintf(&w, "\n- %s", n)
		}
	}
	fmt.Fprintf(&w, "\n\n")
	return w.String()
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

func msList(ds []time.Duration) string {
	if len(ds) == 0 {
		return "-"
	}
	return fmt.Sprintf("%.0f", float64(slices.Max(ds).Microseconds())/1000)
}

// hist is a log-bucketed latency histogram (2% buckets from 1 µs), so that
// a year of claims at full size takes constant memory.
type hist struct {
	n       int64
	buckets map[int]int64
	max     time.Duration
}

const histBase = 1.02

func (h *hist) add(d time.Duration) {
	if h.buckets == nil {
		h.buckets = map[int]int64{}
	}
	us := max(float64(d.Nanoseconds())/1000, 1)
	h.buckets[int(math.Log(us)/math.Log(histBase))]++
	h.n++
	h.max = max(h.max, d)
}

func (h *hist) pct(p float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	idx := make([]int, 0, len(h.buckets))
	for b := range h.buckets {
		idx = append(idx, b)
	}
	slices.Sort(idx)
	want := int64(math.Ceil(p * float64(h.n)))
	var seen int64
	for _, b := range idx {
		seen += h.buckets[b]
		if seen >= want {
			return time.Duration(math.Pow(histBase, float64(b)+0.5) * 1000)
		}
	}
	return h.max
}
