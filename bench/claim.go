package main

import (
	"bufio"
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/migrate"
)

// The claim section: the table of docs/performance.md ("Claim"), each row a
// median ratio of interleaved pgbench rounds against a baseline in the same
// run, on a durable server (fsync, synchronous_commit, full_page_writes on)
// and, as a second column, on a server with fsync off. The databases are in
// the steady state of a 90-day retention with 3 months premade: 9 monthly
// partitions (plus the default one).

// server is one column of the claim table.
type server struct {
	name   string
	url    string // its postgres database
	binDir string
}

// cell is one measured ratio.
type cell struct {
	a, b   float64 // medians (tps, or ms for latency rows)
	ratio  float64
	spread string
	unit   string
	note   string // after the numbers (pgbench: the transactions retried)
}

type v2row struct {
	metric, target string
	cells          map[string]cell
}

type v2table struct {
	title   string // default: the claim table's
	servers []string
	rows    []*v2row
}

func (t *v2table) row(metric, target string) *v2row {
	for _, r := range t.rows {
		if r.metric == metric {
			return r
		}
	}
	r := &v2row{metric: metric, target: target, cells: map[string]cell{}}
	t.rows = append(t.rows, r)
	return r
}

func (t *v2table) write(w io.Writer) {
	if len(t.rows) == 0 {
		return
	}
	title := t.title
	if title == "" {
		title = "Claim (pgbench; median ratio of interleaved rounds, spread min..max)"
	}
	fmt.Fprintf(w, "## %s\n\n", title)
	fmt.Fprintf(w, "| path | %s | target |\n|---|%s---|\n", strings.Join(t.servers, " | "), strings.Repeat("---|", len(t.servers)))
	for _, r := range t.rows {
		var cols []string
		for _, s := range t.servers {
			c, ok := r.cells[s]
			if !ok {
				cols = append(cols, "-")
				continue
			}
			col := fmt.Sprintf("**%.2fx** (%s; %.0f vs %.0f %s)", c.ratio, c.spread, c.a, c.b, c.unit)
			if c.note != "" {
				col += "; " + c.note
			}
			cols = append(cols, col)
		}
		fmt.Fprintf(w, "| %s | %s | %s |\n", r.metric, strings.Join(cols, " | "), r.target)
	}
	fmt.Fprintln(w)
}

// onServers runs section on each server of a two-column table: a durable
// cluster of its own (fsync on) and the bench's (fsync off), or the server
// given with -database-url alone.
func onServers(ctx context.Context, e *env, t *v2table, section string, run func(context.Context, server) error) error {
	var servers []server
	if e.cluster != nil {
		c, err := pgcluster.Start(ctx, pgcluster.Durable())
		if err != nil {
			return fmt.Errorf("start a durable cluster: %w", err)
		}
		defer c.Stop()
		servers = append(servers, server{"durable (fsync on)", c.URL("postgres"), c.BinDir}, server{"fsync off", e.url, e.binDir})
	} else {
		servers = append(servers, server{"the given server", e.url, e.binDir})
	}
	for _, s := range servers {
		t.servers = append(t.servers, s.name)
	}
	for _, s := range servers {
		fmt.Fprintf(os.Stderr, "bench: %s on %s...\n", section, s.name)
		if err := run(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s.name, err)
		}
	}
	return nil
}

// benchClaim fills the claim table on each server.
func benchClaim(ctx context.Context, e *env, o options, t *v2table) error {
	return onServers(ctx, e, t, "claim", func(ctx context.Context, s server) error { return benchClaimOn(ctx, s, o, t) })
}

func benchClaimOn(ctx context.Context, s server, o options, t *v2table) error {
	// Databases: v2 with 9, 15 and 3 monthly partitions, v1 (migration 4)
	// with 9, and one for rotation (it retires months, so it gets its own).
	dbs := map[string]string{}
	for _, d := range []struct {
		name    string
		version int64 // 0: all migrations
		past    int   // monthly partitions before the current month
		drop    int   // premade months to drop (3 partitions: current and two ahead)
	}{
		{"idem_bench_v2_9", 0, 5, 0},
		{"idem_bench_v2_15", 0, 11, 0},
		{"idem_bench_v2_3", 0, 0, 1},
		{"idem_bench_v1_9", 4, 5, 0},
		{"idem_bench_v2_rot", 0, 5, 0},
	} {
		u, err := claimDatabase(ctx, s.url, d.name, d.version, d.past, d.drop)
		if err != nil {
			return fmt.Errorf("%s: %w", d.name, err)
		}
		dbs[d.name] = u
	}
	cmp := func(metric, target, sa, da, sb, db string, clients int) error {
		return pgbenchRow(ctx, s, o, t, metric, target, sa, dbs[da], sb, dbs[db], clients)
	}
	for _, c := range []struct {
		metric, target, sa, da, sb, db string
		clients                        int
	}{
		{"new keys vs raw INSERT .. ON CONFLICT DO NOTHING (plain table), 8 clients", ">= 0.65x (issue 55; aim 0.9x)",
			"claim_new.sql", "idem_bench_v2_9", "raw_insert.sql", "idem_bench_v2_9", 8},
		{"same, 32 clients", ">= 0.45x (aim 0.9x)",
			"claim_new.sql", "idem_bench_v2_9", "raw_insert.sql", "idem_bench_v2_9", 32},
		{"duplicates of completed keys vs the raw conflict path, 8 clients", ">= 0.50x (issue 55; aim 0.9x)",
			"claim_dup.sql", "idem_bench_v2_9", "raw_dup.sql", "idem_bench_v2_9", 8},
		{"new keys with 15 monthly partitions vs 3, 8 clients", ">= 0.90x",
			"claim_new.sql", "idem_bench_v2_15", "claim_new.sql", "idem_bench_v2_3", 8},
		// The ladder: each rung against raw into a plain table.
		{"ladder: raw INSERT into the partitioned parent vs plain table, 8 clients", "information",
			"raw_parent.sql", "idem_bench_v2_9", "raw_insert.sql", "idem_bench_v2_9", 8},
		{"ladder: plpgsql function that only inserts (parent) vs plain table, 8 clients", "information",
			"plpgsql_insert.sql", "idem_bench_v2_9", "raw_insert.sql", "idem_bench_v2_9", 8},
		{"ladder: claim v1 (migration 4) vs plain table, 8 clients", "information",
			"claim_new.sql", "idem_bench_v1_9", "raw_insert.sql", "idem_bench_v1_9", 8},
		{"ladder: claim v2 vs claim v1, new keys, 8 clients", "information",
			"claim_new.sql", "idem_bench_v2_9", "claim_new.sql", "idem_bench_v1_9", 8},
		{"ladder: claim v2 vs claim v1, duplicates, 8 clients", "information",
			"claim_dup.sql", "idem_bench_v2_9", "claim_dup.sql", "idem_bench_v1_9", 8},
	} {
		if err := cmp(c.metric, c.target, c.sa, c.da, c.sb, c.db, c.clients); err != nil {
			return err
		}
	}
	ser, err := serializableDatabase(ctx, s.url)
	if err != nil {
		return err
	}
	if err := serializableRows(ctx, s, o, t, ser, 8); err != nil {
		return err
	}
	return rotationP99(ctx, s, dbs["idem_bench_v2_rot"], o, t)
}

// pgbenchRow puts into t the median of o.rounds interleaved rounds of
// pgbench script sa on database ua against script sb on ub (scripts in
// bench/pgbench), clients clients, on server s.
func pgbenchRow(ctx context.Context, s server, o options, t *v2table, metric, target, sa, ua, sb, ub string, clients int) error {
	c, err := pgbenchCompare(ctx, s, o, pgbenchSide{script: sa, url: ua}, pgbenchSide{script: sb, url: ub}, clients)
	if err != nil {
		return err
	}
	t.row(metric, target).cells[s.name] = c
	return nil
}

// pgbenchSide is one side of a pgbench comparison: a script of
// bench/pgbench run against a database, with pgbench's extra arguments.
type pgbenchSide struct {
	script, url string
	args        []string
}

// pgbenchCompare runs o.rounds interleaved rounds of side a against side b
// with clients clients on server s, and returns the medians, in tps.
func pgbenchCompare(ctx context.Context, s server, o options, a, b pgbenchSide, clients int) (cell, error) {
	bin := "pgbench" // from PATH when the server's binaries are unknown
	if s.binDir != "" {
		bin = filepath.Join(s.binDir, "pgbench")
	}
	if o.rounds < 1 {
		return cell{}, fmt.Errorf("%d rounds: want at least 1", o.rounds)
	}
	var as, bs, rs, ra, rb, fa, fb []float64
	for r := range o.rounds {
		var x, y pgbenchRun
		run := func(first bool) error {
			var err error
			if first {
				x, err = pgbench(ctx, bin, a, clients, o.duration)
			} else {
				y, err = pgbench(ctx, bin, b, clients, o.duration)
			}
			return err
		}
		if err := run(r%2 == 0); err != nil {
			return cell{}, err
		}
		if err := run(r%2 == 1); err != nil {
			return cell{}, err
		}
		as, bs, rs = append(as, x.tps), append(bs, y.tps), append(rs, x.tps/y.tps)
		ra, rb = append(ra, x.retried), append(rb, y.retried)
		fa, fb = append(fa, x.failed), append(fb, y.failed)
	}
	c := cell{a: median(as), b: median(bs), ratio: median(rs), spread: spread(rs), unit: "tps"}
	if retries(a) || retries(b) {
		c.note = fmt.Sprintf("transactions retried: %.1f%% (%.1f..%.1f) vs %.1f%%", median(ra), slices.Min(ra), slices.Max(ra), median(rb))
	}
	if slices.Max(fa) > 0 || slices.Max(fb) > 0 {
		c.note = strings.TrimPrefix(c.note+fmt.Sprintf("; failed after every try: %.1f%% (..%.1f) vs %.1f%% (..%.1f)",
			median(fa), slices.Max(fa), median(fb), slices.Max(fb)), "; ")
	}
	return c, nil
}

// retries: the side's pgbench retries serialization failures.
func retries(s pgbenchSide) bool {
	for _, a := range s.args {
		if strings.HasPrefix(a, "--max-tries") {
			return true
		}
	}
	return false
}

// pgbenchRun is what one pgbench run measured.
type pgbenchRun struct {
	tps float64
	// retried is the percentage of transactions retried after a
	// serialization failure or a deadlock (0 unless the side's args allow
	// retries with --max-tries); failed, of those that failed still after
	// the last try.
	retried, failed float64
}

// pgbench runs one side's script for d (whole seconds, at least one) and
// returns its tps. Below a second (the smoke tests) it runs 20
// transactions per client instead: it works, and measures nothing.
func pgbench(ctx context.Context, bin string, side pgbenchSide, clients int, d time.Duration) (pgbenchRun, error) {
	script := "bench/pgbench/" + side.script
	args := []string{"-n", "-f", script, "-c", strconv.Itoa(clients), "-j", "2"}
	if d < time.Second {
		args = append(args, "-t", "20")
	} else {
		args = append(args, "-T", strconv.Itoa(int(d.Seconds())))
	}
	args = append(append(args, side.args...), side.url)
	cmd := exec.CommandContext(ctx, bin, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return pgbenchRun{}, fmt.Errorf("pgbench %s: %v\n%s", script, err, out.String())
	}
	var r pgbenchRun
	found := false
	sc := bufio.NewScanner(&out)
	tps := regexp.MustCompile(`^tps = ([0-9.]+)`)
	retried := regexp.MustCompile(`^number of transactions retried: [0-9]+ \(([0-9.]+)%\)`)
	failed := regexp.MustCompile(`^number of failed transactions: [0-9]+ \(([0-9.]+)%\)`)
	for sc.Scan() {
		if m := tps.FindStringSubmatch(sc.Text()); m != nil {
			var err error
			if r.tps, err = strconv.ParseFloat(m[1], 64); err != nil {
				return r, err
			}
			found = true
		}
		if m := retried.FindStringSubmatch(sc.Text()); m != nil {
			r.retried, _ = strconv.ParseFloat(m[1], 64)
		}
		if m := failed.FindStringSubmatch(sc.Text()); m != nil {
			r.failed, _ = strconv.ParseFloat(m[1], 64)
		}
	}
	if !found {
		return r, fmt.Errorf("pgbench %s: no tps in output:\n%s", script, out.String())
	}
	return r, nil
}

// serializableRows: new-key claims inside SERIALIZABLE transactions
// against the same claims in READ COMMITTED ones (ser_new.sql, rc_new.sql),
// with the default policy and with a 400-day ttl, pgbench retrying the
// serialization failures; the cell says the share of transactions retried.
func serializableRows(ctx context.Context, s server, o options, t *v2table, dbURL string, clients int) error {
	for _, ttl := range []struct{ days, name string }{{"0", "the default policy"}, {"400", "a 400-day ttl"}} {
		args := []string{"-D", "ttl=" + ttl.days, "--max-tries=100"}
		c, err := pgbenchCompare(ctx, s, o, pgbenchSide{"ser_new.sql", dbURL, args}, pgbenchSide{"rc_new.sql", dbURL, args}, clients)
		if err != nil {
			return fmt.Errorf("SERIALIZABLE, %s: %w", ttl.name, err)
		}
		t.row(fmt.Sprintf("new keys in SERIALIZABLE transactions vs the same in READ COMMITTED, %s, %d clients", ttl.name, clients),
			">= 0.80x, <= 5% retried (issue 55)").cells[s.name] = c
	}
	return nil
}

// serializableDatabase is the SERIALIZABLE rows' database: the steady
// state of a 400-day retention, 13 monthly partitions before the current
// one, each holding keys of the rows' sources in the key space their
// scripts claim from (a 30-day source's in the last month only, where its
// live rows are). A SERIALIZABLE claim of a new key writes a placeholder
// into each other month of its window and reads the key's place in each:
// in months left empty, every claim's placeholder and read meet on the
// index's one page, and SSI aborts most of them (60-70% retried), which a
// table with rows in those months does not see (0.3%, measured
// 2026-11-28).
func serializableDatabase(ctx context.Context, adminURL string) (string, error) {
	u, err := claimDatabase(ctx, adminURL, "idem_bench_ser", 0, 13, 0)
	if err != nil {
		return "", err
	}
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return "", err
	}
	defer conn.Close(ctx)
	for m := 1; m <= 13; m++ {
		at := monthStart(-m).Add(14 * 24 * time.Hour)
		if _, err := conn.Exec(ctx, `
			INSERT INTO idem.processed_events AS e (source, key, first_seen_month, status, token, first_seen, updated_at, completed_at, expires_at, result)
			SELECT s.source, 'new-' || (g % 8 + 1) || '-' || (random() * 1e12)::bigint, date_trunc('month', $1::timestamptz AT TIME ZONE 'UTC')::date,
			       'completed', g, $1, $1, $1, $1 + s.ttl, '{"ok": true}'
			  FROM generate_series(1, 20000) g,
			       (VALUES ('pgbench-iso-400', interval '400 days'), ('pgbench-iso-0', interval '30 days')) s(source, ttl)
			 WHERE s.source = 'pgbench-iso-400' OR $2
			ON CONFLICT DO NOTHING`, at, m == 1); err != nil {
			return "", err
		}
	}
	if _, err := conn.Exec(ctx, `VACUUM ANALYZE idem.processed_events`); err != nil {
		return "", err
	}
	return u, nil
}

// rotationP99: claim p99 while rotation retires four months full of expired
// rows, against the p99 idle right before, 8 clients.
func rotationP99(ctx context.Context, s server, dbURL string, o options, t *v2table) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	claims := claimSQL(pool, "bench-rot")
	var ratios, idleP99, rotP99 []float64
	for r := range o.rounds {
		if err := seedRetirable(ctx, pool, fmt.Sprintf("rot%d", r), -12, o.backlog/8); err != nil {
			return err
		}
		idle, err := measure(ctx, 8, o.duration, claims)
		if err != nil {
			return err
		}
		ws := sampleWaits(ctx, pool)
		d, err := during(ctx, o.duration, claims, func() error {
			_, err := partition.Rotate(ctx, pool, partition.Config{})
			return err
		})
		ws.stop(fmt.Sprintf("%s, claims (pgbench, 8 clients) during rotation, round %d", s.name, r+1))
		if err != nil {
			return err
		}
		idleP99, rotP99 = append(idleP99, ms(idle.pct(0.99))), append(rotP99, ms(d.pct(0.99)))
		ratios = append(ratios, ms(d.pct(0.99))/ms(idle.pct(0.99)))
	}
	t.row("claim p99 during rotation (4 months retired) vs idle, 8 clients", "<= 2x").cells[s.name] =
		cell{a: median(rotP99), b: median(idleP99), ratio: median(ratios), spread: spread(ratios), unit: "ms p99"}
	return nil
}

// claimDatabase creates name on the server of adminURL, migrated to version
// (0: all) with past monthly partitions before the current month and the
// last drop premade months dropped, plus the raw baseline and ladder
// objects, and returns its URL.
func claimDatabase(ctx context.Context, adminURL, name string, version int64, past, drop int) (string, error) {
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return "", err
	}
	defer admin.Close(ctx)
	id := pgx.Identifier{name}.Sanitize()
	if _, err := admin.Exec(ctx, `DROP DATABASE IF EXISTS `+id+` WITH (FORCE)`); err != nil {
		return "", err
	}
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+id); err != nil {
		return "", fmt.Errorf("create database %s (the role needs CREATEDB): %w", name, err)
	}
	u, err := databaseURL(adminURL, name)
	if err != nil {
		return "", err
	}
	cfg, err := pgx.ParseConfig(u)
	if err != nil {
		return "", err
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	if version == 0 {
		_, err = migrate.Up(ctx, db)
	} else {
		err = upTo(ctx, db, version)
	}
	if err != nil {
		return "", fmt.Errorf("migrate: %w", err)
	}
	for m := 1; m <= past; m++ {
		if _, err := db.ExecContext(ctx, `SELECT idem.create_partition($1)`, monthStart(-m)); err != nil {
			return "", err
		}
	}
	for m := 3; m > 3-drop; m-- {
		if _, err := db.ExecContext(ctx, `DROP TABLE `+pgx.Identifier{"idem", "processed_events_p" + monthStart(m).Format("2006_01")}.Sanitize()); err != nil {
			return "", err
		}
	}
	for _, f := range []string{"bench/pgbench/setup.sql", "bench/pgbench/ladder.sql"} {
		if err := execFile(ctx, db, f); err != nil {
			return "", err
		}
	}
	if _, err := db.ExecContext(ctx, `VACUUM ANALYZE`); err != nil {
		return "", err
	}
	return u, nil
}

func upTo(ctx context.Context, db *sql.DB, version int64) error {
	p, err := migrate.NewProvider(db)
	if err != nil {
		return err
	}
	_, err = p.UpTo(ctx, version)
	return err
}

// databaseURL is adminURL (a URL or keyword/value string) for database name.
func databaseURL(adminURL, name string) (string, error) {
	if strings.Contains(adminURL, "://") {
		u, err := url.Parse(adminURL)
		if err != nil {
			return "", err
		}
		u.Path = "/" + name
		return u.String(), nil
	}
	return adminURL + " dbname=" + name, nil // the last dbname wins
}
