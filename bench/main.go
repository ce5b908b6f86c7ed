// Command bench measures idem against raw PostgreSQL baselines in the same
// run and prints a markdown table of ratios (docs/performance.md explains
// every row).
//
//	go run ./bench                 # small sizes, a few minutes on 2 cores
//	go run ./bench -full           # the sizes of docs/performance.md
//	go run ./bench -database-url postgres://...   # an existing database
//
// A and B of each comparison are interleaved (A B, B A, ...) for -rounds
// rounds on the same server, and the table reports the median of the
// per-round ratios and their spread (min..max), because shared machines are
// noisy. Nothing here asserts a target: the targets are printed next to the
// numbers.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

type options struct {
	databaseURL string
	full        bool
	rounds      int
	duration    time.Duration
	clients     []int
	out         string
	only        string
	// sizes
	backlog    int // expired rows prune works through during the latency test
	retireRows int // rows in the month retired by rotation vs DELETE+VACUUM
	scaleSmall int
	scaleLarge int
}

func main() {
	var o options
	flag.StringVar(&o.databaseURL, "database-url", os.Getenv("IDEM_BENCH_DATABASE_URL"), "run against this database (default: a throwaway cluster)")
	flag.BoolVar(&o.full, "full", false, "full sizes: 1M-row retirement, 1M vs 20M rows, longer rounds")
	flag.IntVar(&o.rounds, "rounds", 0, "interleaved rounds per comparison (default 3, full 5)")
	flag.DurationVar(&o.duration, "duration", 0, "length of one side of one round (default 2s, full 5s)")
	flag.StringVar(&o.out, "out", "bench/results.md", "write the markdown table here too")
	flag.StringVar(&o.only, "only", "", "run only the sections whose name contains this (claim, dup, complete, lib, maint, retention, scale, inbox, wait, cache, otel, adopt, plans, dashboard, e2e, batch; ceiling, profile, upgrade, year and layout run only when named)")
	flag.IntVar(&layoutKeys, "layout-keys", 0, "the layout section's keys over its 13 simulated months (default 300000, full 3000000)")
	flag.BoolVar(&layoutTTLChange, "layout-ttl-change", layoutTTLChange, "the layout section: change two sources' ttls at month 6 (forms 7 -> 90 days, ledger 400 -> 30)")
	flag.IntVar(&layoutExtendEvery, "layout-extend-every", layoutExtendEvery, "the layout section: one key in this many has its expiry pushed 45 days past retention after insert (0: none)")
	flag.BoolVar(&layoutFsyncOff, "layout-fsync-off", false, "the layout section: a cluster with fsync off instead of a durable one")
	flag.IntVar(&layoutClaims, "layout-claims", 0, "the layout section: claims per CPU measurement (default 1000)")
	flag.IntVar(&yearKeys, "year-keys", 0, "the year section's new keys over the year (default 150000, full 100000000)")
	flag.IntVar(&yearDays, "year-days", yearDays, "the year section's simulated days")
	flag.StringVar(&yearPrevious, "year-previous-idemctl", "", "the year section: the idemctl of the previous schema version, which maintains the database until the mid-year upgrade (default: built from git; \"-\": no maintenance before the upgrade)")
	flag.Float64Var(&yearKillProb, "year-kill-prob", yearKillProb, "the year section: the chance that a maintenance run is killed (SIGTERM or SIGKILL) at a random moment")
	flag.Uint64Var(&yearSeed, "year-seed", 0, "the year section's random seed (default: the time)")
	flag.Float64Var(&yearRate, "year-rate", 0, "the year section: claims a second per client (8 clients; default 400, full 2000)")
	flag.IntVar(&yearDaysPerTick, "year-days-per-tick", 1, "the year section: simulated days per tick (each tick runs prune and rotate once from each host)")
	flag.Int64Var(&upgradeFrom, "upgrade-from", upgradeFrom, "the upgrade section's starting version")
	flag.IntVar(&upgradeKeys, "upgrade-keys", 0, "the upgrade section's stored keys (default 200000, full 2000000)")
	flag.IntVar(&upgradeClients, "upgrade-clients", upgradeClients, "the upgrade section's claiming clients")
	flag.StringVar(&upgradeIdemctl, "idemctl", "", "the upgrade section: migrate with this idemctl binary (migrate up --river=false) instead of the same code in process")
	flag.Func("clients", "the client counts of the sections that take several, comma-separated (default 8,32)", func(v string) error {
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 || n > 64 {
				return fmt.Errorf("client count %q: want 1 to 64", f)
			}
			o.clients = append(o.clients, n)
		}
		return nil
	})
	flag.IntVar(&profileOps, "profile-ops", 0, "the profile section's operations per phase (default 3000, full 20000)")
	flag.Func("batch-sizes", "the batch section's batch sizes, comma-separated (default 1,10,100,1000)", func(v string) error {
		var sizes []int
		for _, f := range strings.Split(v, ",") {
			n, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || n < 1 || n > idem.MaxBatch {
				return fmt.Errorf("batch size %q: want 1 to %d", f, idem.MaxBatch)
			}
			sizes = append(sizes, n)
		}
		batchSizes = sizes
		return nil
	})
	flag.Parse()
	o.defaults()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, o); err != nil {
		log.Fatalf("bench: %v", err)
	}
}

func (o *options) defaults() {
	if o.clients == nil {
		o.clients = []int{8, 32}
	}
	if o.full {
		o.backlog, o.retireRows, o.scaleSmall, o.scaleLarge = 2_000_000, 1_000_000, 1_000_000, 20_000_000
		if o.rounds == 0 {
			o.rounds = 5
		}
		if o.duration == 0 {
			o.duration = 5 * time.Second
		}
	} else {
		o.backlog, o.retireRows, o.scaleSmall, o.scaleLarge = 200_000, 200_000, 100_000, 1_000_000
		if o.rounds == 0 {
			o.rounds = 3
		}
		if o.duration == 0 {
			o.duration = 2 * time.Second
		}
	}
}

// env is the database under test.
type env struct {
	url     string
	pool    *pgxpool.Pool
	cluster *pgcluster.Cluster
	binDir  string
}

func setup(ctx context.Context, o options) (*env, error) {
	e := &env{url: o.databaseURL}
	if e.url == "" {
		c, err := pgcluster.Start(ctx)
		if err != nil {
			return nil, fmt.Errorf("start a throwaway PostgreSQL (%s, or pass -database-url): %w", pgcluster.InstallHint, err)
		}
		e.cluster, e.url, e.binDir = c, c.URL("postgres"), c.BinDir
	} else if d, err := pgcluster.FindBinDir(); err == nil {
		e.binDir = d
	}
	cfg, err := pgxpool.ParseConfig(e.url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 80
	if e.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	db := stdlib.OpenDBFromPool(e.pool)
	defer db.Close()
	if _, err := migrate.Up(ctx, db); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if err := execFile(ctx, db, "bench/pgbench/setup.sql"); err != nil {
		return nil, err
	}
	return e, nil
}

func execFile(ctx context.Context, db *sql.DB, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("%w (run the benchmark from the repository root)", err)
	}
	_, err = db.ExecContext(ctx, string(b))
	return err
}

func (e *env) close() {
	e.pool.Close()
	if e.cluster != nil {
		e.cluster.Stop()
	}
}

func run(ctx context.Context, o options) error {
	start := time.Now()
	e, err := setup(ctx, o)
	if err != nil {
		return err
	}
	defer e.close()
	var version string
	_ = e.pool.QueryRow(ctx, `SELECT version()`).Scan(&version)
	settings := serverSettings(ctx, e.pool)
	fmt.Fprintf(os.Stderr, "bench: %s\n", version)

	t := &table{}
	claims := &v2table{}
	e2e := &v2table{title: "End to end, through the Go API (median ratio of interleaved rounds, spread min..max)"}
	batch := &v2table{title: "Batch claims: keys per second (median ratio of interleaved rounds, spread min..max)"}
	floor := &v2table{title: "The floor: the shipped single-key claim and completion against the least they can do on idem.processed_events (bench/ceiling/floor.sql; pgbench; median ratio of interleaved rounds, spread min..max)"}
	profile := &strings.Builder{}
	ceiling := &v2table{title: "Batch ceilings: DoBatch with the protocol functions reduced to the least that answers (experiments, never migrations; median ratio of interleaved rounds, spread min..max)"}
	sections := []struct {
		name string
		fn   func(context.Context, *env, options, *table) error
	}{
		{"claim", func(ctx context.Context, e *env, o options, _ *table) error { return benchClaim(ctx, e, o, claims) }},
		{"dup", benchDuplicates},
		{"complete", benchComplete},
		{"lib", benchLibrary},
		{"maint", benchMaintenance},
		{"retention", benchRetention},
		{"scale", benchScale},
		{"inbox", benchInbox},
		{"wait", benchWait},
		{"cache", benchCache},
		{"otel", benchOTel},
		{"adopt", benchAdopt},
		{"plans", benchPlans},
		{"dashboard", benchDashboard},
		{"e2e", func(ctx context.Context, e *env, o options, _ *table) error { return benchE2E(ctx, e, o, e2e) }},
		{"batch", func(ctx context.Context, e *env, o options, _ *table) error { return benchBatch(ctx, e, o, batch) }},
		// Opt-in: -only ceiling, -only profile, -only upgrade, -only year, -only layout.
		{"ceiling", func(ctx context.Context, e *env, o options, _ *table) error {
			return benchCeiling(ctx, e, o, ceiling, floor)
		}},
		{"profile", func(ctx context.Context, e *env, o options, _ *table) error { return benchProfile(ctx, e, o, profile) }},
		{"upgrade", benchUpgrade},
		{"year", benchYear},
		{"layout", benchLayout},
	}
	for _, s := range sections {
		if (o.only != "" && !strings.Contains(s.name, o.only)) || (o.only == "" && (s.name == "ceiling" || s.name == "profile" || s.name == "upgrade" || s.name == "year" || s.name == "layout")) {
			continue
		}
		fmt.Fprintf(os.Stderr, "bench: %s...\n", s.name)
		if err := s.fn(ctx, e, o, t); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}

	var w strings.Builder
	fmt.Fprintf(&w, "# idem benchmark results\n\n")
	fmt.Fprintf(&w, "- when: %s, took %s\n", time.Now().UTC().Format(time.RFC3339), time.Since(start).Round(time.Second))
	fmt.Fprintf(&w, "- machine: %d CPUs (%s/%s), Go %s\n", runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, runtime.Version())
	fmt.Fprintf(&w, "- server: %s\n", version)
	fmt.Fprintf(&w, "- settings: %s\n", settings)
	fmt.Fprintf(&w, "- sizes: %s; %d interleaved rounds of %s per side\n\n", sizes(o), o.rounds, o.duration)
	claims.write(&w)
	e2e.write(&w)
	batch.write(&w)
	floor.write(&w)
	ceiling.write(&w)
	w.WriteString(profile.String())
	if len(waitNotes) > 0 {
		fmt.Fprintf(&w, "## What the statements wait on (pg_stat_activity sampled every 5 ms; CPU: no wait event)\n\n%s\n\n", strings.Join(waitNotes, "\n"))
	}
	if yearTable != "" {
		fmt.Fprintf(&w, "## A year in an hour\n\n%s", yearTable)
	}
	if layoutTable != "" {
		fmt.Fprintf(&w, "## Retention layouts compared\n\n%s", layoutTable)
	}
	fmt.Fprintf(&w, "## The rest (settings above)\n\n")
	t.write(&w)
	fmt.Print(w.String())
	if o.out != "" {
		if err := os.WriteFile(o.out, []byte(w.String()), 0o644); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: wrote %s\n", o.out)
	}
	return nil
}

func sizes(o options) string {
	if o.full {
		return "full"
	}
	return fmt.Sprintf("small (backlog %d, retired month %d rows, scale %d vs %d rows)", o.backlog, o.retireRows, o.scaleSmall, o.scaleLarge)
}

func serverSettings(ctx context.Context, pool *pgxpool.Pool) string {
	var parts []string
	for _, name := range []string{"fsync", "synchronous_commit", "shared_buffers", "max_connections"} {
		var v string
		if err := pool.QueryRow(ctx, "SELECT current_setting($1)", name).Scan(&v); err == nil {
			parts = append(parts, name+"="+v)
		}
	}
	return strings.Join(parts, ", ")
}

func migrateURL(ctx context.Context, p *pgxpool.Pool) error {
	db := stdlib.OpenDBFromPool(p)
	defer db.Close()
	_, err := migrate.Up(ctx, db)
	return err
}
