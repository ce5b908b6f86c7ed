package main

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgcluster"
)

// The profile section (opt-in: -only profile): the server time of each
// statement of the single-key claim and completion, from
// pg_stat_statements with pg_stat_statements.track = all, so that the
// statements run inside the protocol's PL/pgSQL functions are counted
// (nested, toplevel false) beside the call itself. On a throwaway cluster
// of its own (fsync off, the library preloaded), or on the server given
// with -database-url if it preloads pg_stat_statements and this role may
// reset it. The database is the claim section's steady state (9 monthly
// partitions, 10000 completed keys of source pgbench-dup), with the
// ceiling section's minimal claim (ceiling/floor.sql) beside idem's for
// comparison.
//
// Each phase resets the statistics, runs profileCalls() calls one after
// the other on one connection (no contention: each statement's own time),
// and prints a markdown table: per statement, its calls per operation, its
// mean server time, and their product, the time it adds to one operation.
// A nested statement's time includes the statements it runs in turn (a
// PERFORM of a function that queries); the call's row is the whole server
// time of one operation, parse and commit excepted.

// profileOps is the number of operations of each phase (0: the default).
var profileOps int

func profileCalls(o options) int {
	switch {
	case profileOps > 0:
		return profileOps
	case o.full:
		return 20000
	}
	return 3000
}

// profilePhase is one measured operation: prepare readies what it needs
// (outside the measurement), op runs the i-th operation.
type profilePhase struct {
	name    string
	prepare func(ctx context.Context, conn *pgx.Conn, n int) error
	op      func(ctx context.Context, conn *pgx.Conn, i int) error
}

func benchProfile(ctx context.Context, e *env, o options, w *strings.Builder) error {
	url := e.url
	if e.cluster != nil {
		c, err := profileCluster(ctx)
		if err != nil {
			return err
		}
		defer c.Stop()
		url = c.URL("postgres")
	}
	return profileOn(ctx, url, profileCalls(o), w)
}

// profileCluster starts a throwaway cluster with pg_stat_statements loaded
// and tracking nested statements.
func profileCluster(ctx context.Context) (*pgcluster.Cluster, error) {
	c, err := pgcluster.Start(ctx)
	if err != nil {
		return nil, fmt.Errorf("start a throwaway PostgreSQL: %w", err)
	}
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		c.Stop()
		return nil, err
	}
	// The library first: its settings are known once it is loaded.
	if _, err := conn.Exec(ctx, `ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'`); err != nil {
		conn.Close(ctx)
		c.Stop()
		return nil, err
	}
	conn.Close(ctx)
	if err := c.Restart(ctx); err != nil {
		c.Stop()
		return nil, fmt.Errorf("restart with pg_stat_statements loaded (the server's contrib package has it): %w", err)
	}
	if conn, err = pgx.Connect(ctx, c.URL("postgres")); err != nil {
		c.Stop()
		return nil, err
	}
	defer conn.Close(ctx)
	for _, q := range []string{
		`ALTER SYSTEM SET pg_stat_statements.track = 'all'`,
		`ALTER SYSTEM SET pg_stat_statements.track_utility = off`,
		`ALTER SYSTEM SET track_functions = 'all'`,
		`SELECT pg_reload_conf()`,
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			c.Stop()
			return nil, err
		}
	}
	// The reload is signalled, not waited for: wait until a new session
	// sees it.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		var track string
		err := func() error {
			s, err := pgx.Connect(ctx, c.URL("postgres"))
			if err != nil {
				return err
			}
			defer s.Close(ctx)
			return s.QueryRow(ctx, `SELECT current_setting('pg_stat_statements.track')`).Scan(&track)
		}()
		if err == nil && track == "all" {
			break
		}
		if time.Now().After(deadline) {
			c.Stop()
			return nil, fmt.Errorf("pg_stat_statements.track is still %q after the reload: %v", track, err)
		}
	}
	return c, nil
}

func profileOn(ctx context.Context, adminURL string, n int, w *strings.Builder) error {
	u, err := claimDatabase(ctx, adminURL, "idem_bench_profile", 0, 5, 0)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, u)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var track string
	if err := conn.QueryRow(ctx, `SELECT coalesce(current_setting('pg_stat_statements.track', true), '')`).Scan(&track); err != nil {
		return err
	}
	if track != "all" {
		return fmt.Errorf("the server does not preload pg_stat_statements with pg_stat_statements.track = all (it is %q): "+
			"run the section without -database-url, or set both in postgresql.conf and restart", track)
	}
	if _, err := conn.Exec(ctx, `CREATE EXTENSION IF NOT EXISTS pg_stat_statements`); err != nil {
		return err
	}
	floor, err := ceilingSQL.ReadFile("ceiling/floor.sql")
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, string(floor)); err != nil {
		return fmt.Errorf("ceiling/floor.sql: %w", err)
	}

	// The first calls of a session plan the functions' statements: each
	// phase runs warm operations first, outside the statistics.
	warm := min(n, 100)
	keys := make([]string, warm+n)
	tokens := make([]int64, warm+n)
	claimNew := func(source string) func(ctx context.Context, conn *pgx.Conn, i int) error {
		return func(ctx context.Context, conn *pgx.Conn, i int) error {
			keys[i] = newKey()
			var outcome string
			if err := conn.QueryRow(ctx, `SELECT outcome, token FROM idem.claim($1, $2)`, source, keys[i]).Scan(&outcome, &tokens[i]); err != nil {
				return err
			}
			if outcome != "acquired" {
				return fmt.Errorf("a new key's claim answered %s", outcome)
			}
			return nil
		}
	}
	// serializable claims new keys of source in SERIALIZABLE transactions,
	// with ttl (nil: the policy's).
	serializable := func(name, source string, ttl any) profilePhase {
		return profilePhase{name: "idem.claim of a new key in a SERIALIZABLE transaction, " + name + " (BEGIN and COMMIT not counted)",
			op: func(ctx context.Context, conn *pgx.Conn, i int) error {
				return pgx.BeginTxFunc(ctx, conn, pgx.TxOptions{IsoLevel: pgx.Serializable}, func(tx pgx.Tx) error {
					var outcome string
					return tx.QueryRow(ctx, `SELECT outcome FROM idem.claim($1, $2, ttl => $3::interval)`, source, newKey(), ttl).Scan(&outcome)
				})
			}}
	}
	phases := []profilePhase{
		{name: "idem.claim of a new key", op: claimNew("profile")},
		{name: "idem.complete_stored of the key claimed (what Do sends after the work)",
			prepare: func(ctx context.Context, conn *pgx.Conn, n int) error {
				for i := range n {
					if err := claimNew("profile")(ctx, conn, i); err != nil {
						return err
					}
				}
				return nil
			},
			op: func(ctx context.Context, conn *pgx.Conn, i int) error {
				var outcome, stored string
				if err := conn.QueryRow(ctx, `SELECT outcome, stored FROM idem.complete_stored($1, $2, $3, $4)`,
					"profile", keys[i], tokens[i], `{"ok": true}`).Scan(&outcome, &stored); err != nil {
					return err
				}
				if outcome != "completed" {
					return fmt.Errorf("a completion answered %s", outcome)
				}
				return nil
			}},
		{name: "idem.claim of a duplicate (a completed key)",
			op: func(ctx context.Context, conn *pgx.Conn, i int) error {
				var outcome string
				if err := conn.QueryRow(ctx, `SELECT outcome FROM idem.claim($1, $2)`, "pgbench-dup", fmt.Sprintf("dup-%d", 1+i%10000)).Scan(&outcome); err != nil {
					return err
				}
				if outcome != "completed" {
					return fmt.Errorf("a duplicate's claim answered %s", outcome)
				}
				return nil
			}},
		{name: "bench_floor_claim of a new key (the minimal claim of the ceiling section, for comparison)",
			op: func(ctx context.Context, conn *pgx.Conn, i int) error {
				var outcome string
				if err := conn.QueryRow(ctx, `SELECT outcome FROM bench_floor_claim($1, $2)`, "profile-floor", newKey()).Scan(&outcome); err != nil {
					return err
				}
				if outcome != "acquired" {
					return fmt.Errorf("the minimal claim of a new key answered %s", outcome)
				}
				return nil
			}},
		serializable("the default policy", "profile-serializable", nil),
		serializable("a 400-day ttl", "profile-serializable-400", "400 days"),
	}
	var version string
	if err := conn.QueryRow(ctx, `SELECT current_setting('server_version')`).Scan(&version); err != nil {
		return err
	}
	fmt.Fprintf(w, "## Per-step profile: server time of each statement (pg_stat_statements, track = all; PostgreSQL %s)\n\n", version)
	fmt.Fprintf(w, "%d operations per phase, one after the other on one connection; a nested statement's time includes what it runs in turn.\n\n", n)
	for _, p := range phases {
		fmt.Fprintf(os.Stderr, "bench: profile: %s...\n", p.name)
		if p.prepare != nil {
			if err := p.prepare(ctx, conn, warm+n); err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
		}
		for i := range warm {
			if err := p.op(ctx, conn, i); err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
		}
		before, err := profileCounts(ctx, conn)
		if err != nil {
			return err
		}
		if _, err := conn.Exec(ctx, `SELECT pg_stat_statements_reset()`); err != nil {
			return err
		}
		for i := range n {
			if err := p.op(ctx, conn, warm+i); err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
		}
		if err := profileTable(ctx, conn, p.name, n, w); err != nil {
			return err
		}
		after, err := profileCounts(ctx, conn)
		if err != nil {
			return err
		}
		profileFunctions(before, after, n, w)
		if upd := after.upd - before.upd; upd > 0 {
			fmt.Fprintf(w, "Updates of idem.processed_events: %.2f per operation, %.0f%% of them HOT (n_tup_hot_upd).\n\n",
				float64(upd)/float64(n), 100*float64(after.hot-before.hot)/float64(upd))
		}
	}
	return nil
}

// counts are what the statistics collector has counted so far: the
// updates of idem.processed_events' partitions and the calls of each
// function (track_functions = all).
type counts struct {
	upd, hot int64
	funcs    map[string]funcCount
}

type funcCount struct {
	calls       int64
	total, self float64 // ms
}

// profileCounts reads the counts, this session's included: they are
// flushed to the statistics once the session is idle after a forced
// flush.
func profileCounts(ctx context.Context, conn *pgx.Conn) (counts, error) {
	c := counts{funcs: map[string]funcCount{}}
	if _, err := conn.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
		return c, err
	}
	if _, err := conn.Exec(ctx, `SELECT 1`); err != nil {
		return c, err
	}
	if err := conn.QueryRow(ctx, `
		SELECT coalesce(sum(t.n_tup_upd), 0)::bigint, coalesce(sum(t.n_tup_hot_upd), 0)::bigint
		  FROM pg_stat_user_tables t
		 WHERE t.relid IN (SELECT i.inhrelid FROM pg_inherits i WHERE i.inhparent = 'idem.processed_events'::regclass)`).Scan(&c.upd, &c.hot); err != nil {
		return c, err
	}
	rows, err := conn.Query(ctx, `SELECT f.schemaname || '.' || f.funcname, f.calls, f.total_time, f.self_time
		FROM pg_stat_user_functions f WHERE f.funcname NOT LIKE 'pg_stat_statements%'`)
	if err != nil {
		return c, err
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var f funcCount
		if err := rows.Scan(&name, &f.calls, &f.total, &f.self); err != nil {
			return c, err
		}
		g := c.funcs[name] // overloads add up
		c.funcs[name] = funcCount{g.calls + f.calls, g.total + f.total, g.self + f.self}
	}
	return c, rows.Err()
}

// profileFunctions writes the functions called between before and after
// (PL/pgSQL and SQL functions not inlined): calls, total and own time per
// operation, the most expensive first.
func profileFunctions(before, after counts, n int, w *strings.Builder) {
	type row struct {
		name string
		funcCount
	}
	var rows []row
	for name, a := range after.funcs {
		b := before.funcs[name]
		if d := (funcCount{a.calls - b.calls, a.total - b.total, a.self - b.self}); d.calls > 0 {
			rows = append(rows, row{name, d})
		}
	}
	if len(rows) == 0 {
		return
	}
	slices.SortFunc(rows, func(x, y row) int { return cmp.Compare(y.total, x.total) })
	fmt.Fprintf(w, "| function (pg_stat_user_functions, track_functions = all) | calls per operation | µs per operation | of it its own (self) |\n|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(w, "| `%s` | %.2f | %.1f | %.1f |\n", r.name, float64(r.calls)/float64(n), r.total*1000/float64(n), r.self*1000/float64(n))
	}
	fmt.Fprintln(w)
}

// profileTable writes the statistics of the phase just run as a markdown
// table: the top-level statements first, then the nested ones by the time
// they add to an operation.
func profileTable(ctx context.Context, conn *pgx.Conn, name string, n int, w *strings.Builder) error {
	rows, err := conn.Query(ctx, `
		SELECT s.toplevel, s.calls, s.mean_exec_time, s.total_exec_time, s.query
		  FROM pg_stat_statements s
		 WHERE s.dbid = (SELECT d.oid FROM pg_database d WHERE d.datname = current_database())
		   AND s.query NOT LIKE '%pg_stat_statements%'
		 ORDER BY s.toplevel DESC, s.total_exec_time DESC`)
	if err != nil {
		return err
	}
	type stat struct {
		top          bool
		calls        int64
		mean, total  float64
		query        string
		perOperation float64
	}
	stats, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (stat, error) {
		var s stat
		err := r.Scan(&s.top, &s.calls, &s.mean, &s.total, &s.query)
		s.perOperation = s.total / float64(n)
		return s, err
	})
	if err != nil {
		return err
	}
	fmt.Fprintf(w, "### %s\n\n", name)
	fmt.Fprintf(w, "| statement | level | calls per operation | mean µs | µs per operation |\n|---|---|---|---|---|\n")
	for _, s := range stats {
		level := "nested"
		if s.top {
			level = "**call**"
		}
		fmt.Fprintf(w, "| `%s` | %s | %.2f | %.1f | %.1f |\n", profileQuery(s.query), level, float64(s.calls)/float64(n), s.mean*1000, s.perOperation*1000)
	}
	fmt.Fprintln(w)
	var call, nested float64
	for _, s := range stats {
		if s.top {
			call += s.perOperation
		} else {
			nested += s.perOperation
		}
	}
	fmt.Fprintf(w, "Outside every statement counted (PL/pgSQL itself, simple expressions, the function call's settings, executor start and end: "+
		"pg_stat_statements times a statement's run only): at least %.1f µs per operation, the call's %.1f less its nested statements' %.1f.\n\n",
		(call-nested)*1000, call*1000, nested*1000)
	return nil
}

var spaces = regexp.MustCompile(`\s+`)

// profileQuery is a statement's text on one line of a markdown table,
// cut at 140 characters.
func profileQuery(q string) string {
	q = strings.TrimSpace(spaces.ReplaceAllString(q, " "))
	if r := []rune(q); len(r) > 140 {
		q = string(r[:137]) + "..."
	}
	return strings.NewReplacer("|", `\|`, "`", "'").Replace(q)
}
