package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/pgcluster"
)

// The layout section (opt-in: -only layout) is issue 56's measured
// prototype of processed_events' retention layout: it builds candidate
// layouts in scratch schemas of one throwaway cluster of its own (durable
// unless -layout-fsync-off; autovacuum off, so that each step's WAL is its
// own and the VACUUM a DELETE needs is measured apart), loads the same
// data into each, and measures what retention (right after a CHECKPOINT
// at each month's end), claims and an online upgrade cost in each. Before
// the claims it checks that every layout kept exactly the live rows and
// that its claim finds them. Nothing here is idem's schema: the tables have
// processed_events' columns, and the claim is the minimal one (the key's
// advisory lock, one read of the source's settings, one probe of the
// window, one insert ON CONFLICT DO NOTHING; PL/pgSQL with
// plan_cache_mode = force_generic_plan as idem's functions are).
//
// The layouts (schema: partitioning):
//
//   - lay_base, today's: RANGE (first_seen_month); rotation drops a month
//     whose rows have all expired, prune DELETEs expired rows everywhere
//     else.
//   - lay_class, "class under month": RANGE (first_seen_month), each month
//     RANGE (retention_class), the class picked at insert from the
//     source's ttl (<=8, <=35, <=65, <=95, <=190, <=400 days, longer in the
//     month's default leaf); leaves are made only for the classes of the
//     sources' current ttls. A leaf is due at its month's end plus its
//     class's bound; then it is dropped, its rows still live (a lease
//     extended past retention) first moved under each key's lock to the
//     class that covers them.
//   - lay_retire_lag and lay_retire_move, "expiry month": RANGE
//     (retire_month), the month of expires_at at insert. A month is due at
//     its end. A row whose expires_at later moved past its month's end
//     (here: an extended lease) is found through a per-source lag (the
//     probe's lower end is the month of now - lag). At the due month's end
//     _lag leaves a month holding such rows as it is (no DELETE), and a
//     later month's end drops it once its last live row expired; _move
//     moves them under each key's lock to the month of their expiry and
//     drops the month.
//     Rows whose expiry is beyond the premade horizon (15 months) go to a
//     far partition (retire_month = 2999-01-01), pruned by DELETE.
//
// Every layout has a top-level DEFAULT partition (a claim never fails for
// want of a partition), pruned by DELETE, and an index on (expires_at,
// source, key) as processed_events has.
//
// The data: -layout-keys keys over 13 simulated months (2025-01 to
// 2026-01), 5 sources (forms 7 days, d30, d60, d90, ledger 400 days) plus
// 0.1% of an "archive" source with a 10-year ttl; at month 6 forms goes
// 7 -> 90 days and ledger 400 -> 30 (-layout-ttl-change=false: no
// change); 0.1% of rows (-layout-extend-every) have their expires_at
// pushed 45 days past retention after insert (a lease extended), without
// moving. Rotation and retention run at every month's end; the claims run
// in the year's last hour on the steady-state partitions.

var (
	layoutKeys      int
	layoutTTLChange = true
	layoutClaims    int
	layoutFsyncOff  bool
	// One key in layoutExtendEvery (0: none) has its expires_at pushed 45
	// days past retention after insert.
	layoutExtendEvery = 997
	layoutTable       string // the section's markdown, for the report
)

const (
	layoutMonths  = 13
	layoutStart   = "2025-01-01"
	layoutHorizon = 15 // months premade ahead of the current one for retire months
	layoutFar     = "2999-01-01"
)

type layoutDef struct {
	schema string
	name   string
	kind   string // base, class, retire
	move   bool   // retire: move rows still live at the due month's end
}

var layouts = []layoutDef{
	{"lay_base", "today: first-seen month, prune", "base", false},
	{"lay_class", "A: class under first-seen month", "class", true},
	{"lay_retire_lag", "B: retire month, lag, keep a month until its last row expires", "retire", false},
	{"lay_retire_move", "B: retire month, move leftovers", "retire", true},
}

// layoutCommon is the helpers and the data generator shared by every layout.
const layoutCommon = `
CREATE SCHEMA lay;
CREATE FUNCTION lay.month(t timestamptz) RETURNS date LANGUAGE sql IMMUTABLE
  AS $$ SELECT (date_trunc('month', t AT TIME ZONE 'UTC'))::date $$;
CREATE FUNCTION lay.class_of(days numeric) RETURNS smallint LANGUAGE sql IMMUTABLE
  AS $$ SELECT CASE WHEN days <= 8 THEN 0 WHEN days <= 35 THEN 1 WHEN days <= 65 THEN 2 WHEN days <= 95 THEN 3
                    WHEN days <= 190 THEN 4 WHEN days <= 400 THEN 5 ELSE 6 END::smallint $$;
CREATE FUNCTION lay.class_bound(c smallint) RETURNS int LANGUAGE sql IMMUTABLE
  AS $$ SELECT (ARRAY[8, 35, 65, 95, 190, 400, 100000])[c + 1] $$;
-- Immutable in fact (the horizon compared in UTC), so that it is inlined:
-- a SQL function declared IMMUTABLE whose body is only STABLE is called,
-- not inlined, on every evaluation.
CREATE FUNCTION lay.retire(expires timestamptz, now timestamptz) RETURNS date LANGUAGE sql IMMUTABLE
  AS $$ SELECT CASE WHEN expires < ((lay.month(now) + interval '` + "15" + ` months') AT TIME ZONE 'UTC') THEN lay.month(expires) ELSE date '` + layoutFar + `' END $$;
CREATE FUNCTION lay.ttl(source text, m int, change bool) RETURNS int LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE source WHEN 'forms' THEN CASE WHEN change AND m >= 6 THEN 90 ELSE 7 END
                     WHEN 'd30' THEN 30 WHEN 'd60' THEN 60 WHEN 'd90' THEN 90
                     WHEN 'ledger' THEN CASE WHEN change AND m >= 6 THEN 30 ELSE 400 END
                     ELSE 3650 END $$;
CREATE TABLE lay.sources (source text PRIMARY KEY);
INSERT INTO lay.sources VALUES ('forms'), ('d30'), ('d60'), ('d90'), ('ledger'), ('archive');
-- Month m's n keys, in first-seen order. expires_insert is what the claim
-- wrote; expires_at is the row's expiry now (45 days later for the 0.1%
-- whose lease was extended past retention).
CREATE FUNCTION lay.gen(m int, n int, change bool, extend_every int)
RETURNS TABLE (source text, key text, first_seen timestamptz, first_seen_month date, ttl int,
               expires_insert timestamptz, expires_at timestamptz, fingerprint text, result jsonb, token bigint)
LANGUAGE sql STABLE AS $$
  SELECT s.source, md5(m || '-' || j), f.fs, lay.month(f.fs), lay.ttl(s.source, m, change),
         f.fs + make_interval(days => lay.ttl(s.source, m, change)),
         f.fs + make_interval(days => lay.ttl(s.source, m, change))
              + CASE WHEN extend_every > 0 AND j % extend_every = 7 THEN interval '45 days' ELSE interval '0' END,
         md5(j::text) || md5((j + 1)::text),
         jsonb_build_object('id', j, 'status', 'ok', 'amount', j % 100000, 'body', repeat(md5(m || ':' || j), 4)),
         (abs(hashtext(m || '/' || j))::bigint << 20) + j
    FROM generate_series(1, n) j
   CROSS JOIN LATERAL (SELECT timestamptz '` + layoutStart + ` 00:00:00+00' + make_interval(months => m) AS ms) b
   CROSS JOIN LATERAL (SELECT b.ms + (b.ms + interval '1 month' - b.ms) * ((j - 0.5) / n) AS fs) f
   CROSS JOIN LATERAL (SELECT CASE WHEN j % 991 = 3 THEN 'archive'
                                   ELSE (ARRAY['forms', 'd30', 'd60', 'd90', 'ledger'])[1 + j % 5] END AS source) s
$$;
-- The partitions each layout has made, for rotation and retention.
CREATE TABLE lay.parts (
  schema text, rel text, parent text, kind text, lo date, class smallint,
  due timestamptz, alive bool NOT NULL DEFAULT true, PRIMARY KEY (schema, rel));
`

// layoutColumns is processed_events' columns (migration 28) after the
// partition columns.
const layoutColumns = `
  event_type text, status text NOT NULL, attempts integer NOT NULL DEFAULT 1, token bigint NOT NULL,
  lease_expires_at timestamptz, fingerprint text, result jsonb, last_error text, retryable boolean,
  first_seen timestamptz NOT NULL, updated_at timestamptz NOT NULL, completed_at timestamptz,
  expires_at timestamptz NOT NULL, duplicates integer NOT NULL DEFAULT 0, last_seen_at timestamptz`

func layoutSchemaSQL(l layoutDef) string {
	s := l.schema
	var b strings.Builder
	fmt.Fprintf(&b, "CREATE SCHEMA %s;\n", s)
	// The settings a claim reads after the key's lock: ttl, lookback (an
	// upper bound on expires_at - first_seen), lag (on expires_at - the
	// expiry the row was placed by), the largest class a row can be in.
	fmt.Fprintf(&b, "CREATE TABLE %s.settings (source text PRIMARY KEY, ttl_days int NOT NULL, lookback_days int NOT NULL, lag_days int NOT NULL, max_class smallint NOT NULL);\n", s)
	switch l.kind {
	case "base":
		fmt.Fprintf(&b, "CREATE TABLE %s.events (source text NOT NULL, key text NOT NULL, first_seen_month date NOT NULL, %s,\n PRIMARY KEY (source, key, first_seen_month)) PARTITION BY RANGE (first_seen_month);\n", s, layoutColumns)
	case "class":
		fmt.Fprintf(&b, "CREATE TABLE %s.events (source text NOT NULL, key text NOT NULL, first_seen_month date NOT NULL, retention_class smallint NOT NULL, %s,\n PRIMARY KEY (source, key, first_seen_month, retention_class)) PARTITION BY RANGE (first_seen_month);\n", s, layoutColumns)
	case "retire":
		fmt.Fprintf(&b, "CREATE TABLE %s.events (source text NOT NULL, key text NOT NULL, retire_month date NOT NULL, first_seen_month date NOT NULL, %s,\n PRIMARY KEY (source, key, retire_month)) PARTITION BY RANGE (retire_month);\n", s, layoutColumns)
		fmt.Fprintf(&b, "CREATE TABLE %s.events_far PARTITION OF %s.events FOR VALUES FROM ('%s') TO (MAXVALUE);\n", s, s, layoutFar)
		fmt.Fprintf(&b, "INSERT INTO lay.parts (schema, rel, parent, kind) VALUES ('%s', '%s.events_far', '%s.events', 'far');\n", s, s, s)
	}
	fmt.Fprintf(&b, "CREATE INDEX ON %s.events (expires_at, source, key);\n", s)
	fmt.Fprintf(&b, "CREATE TABLE %s.events_default PARTITION OF %s.events DEFAULT;\n", s, s)
	fmt.Fprintf(&b, "INSERT INTO lay.parts (schema, rel, parent, kind) VALUES ('%s', '%s.events_default', '%s.events', 'default');\n", s, s, s)

	// The minimal claim of this layout: p_now is the simulated clock.
	probe := layoutProbe(l.kind)
	var insCols, insVals string
	switch l.kind {
	case "base":
		insCols, insVals = "first_seen_month", "lay.month(p_now)"
	case "class":
		insCols, insVals = "first_seen_month, retention_class", "lay.month(p_now), lay.class_of(st.ttl_days)"
	case "retire":
		insCols, insVals = "retire_month, first_seen_month", "lay.retire(p_now + make_interval(days => st.ttl_days), p_now), lay.month(p_now)"
	}
	fmt.Fprintf(&b, `CREATE FUNCTION %[1]s.claim(p_source text, p_key text, p_now timestamptz, OUT outcome text)
 LANGUAGE plpgsql SET plan_cache_mode TO force_generic_plan
AS $f$
DECLARE
    st record;
    r  record;
BEGIN
    PERFORM pg_advisory_xact_lock(1768187245, hashtext(p_source || chr(31) || p_key));
    SELECT * INTO st FROM %[1]s.settings s WHERE s.source = p_source;
    SELECT e.status, e.result INTO r FROM %[1]s.events e
     WHERE e.source = p_source AND e.key = p_key
       AND %[2]s
       AND e.expires_at > p_now
     LIMIT 1;
    IF FOUND THEN
        outcome := CASE r.status WHEN 'processing' THEN 'in_progress' ELSE r.status END;
        RETURN;
    END IF;
    INSERT INTO %[1]s.events AS e (source, key, %[3]s, event_type, status, attempts, token,
            lease_expires_at, fingerprint, first_seen, updated_at, expires_at)
    VALUES (p_source, p_key, %[4]s, NULL, 'processing', 1, (random() * 9e18)::bigint,
            p_now + interval '2 minutes', NULL, p_now, p_now, p_now + make_interval(days => st.ttl_days))
    ON CONFLICT DO NOTHING;
    outcome := CASE WHEN FOUND THEN 'acquired' ELSE 'in_progress' END;
END
$f$;
`, s, probe, insCols, insVals)
	return b.String()
}

// layoutProbe is the window of a layout's claim: the partitions a live
// row of the key can be in.
func layoutProbe(kind string) string {
	switch kind {
	case "class":
		return `e.first_seen_month >= lay.month(p_now - make_interval(days => st.lookback_days))
       AND e.first_seen_month <= lay.month(p_now + interval '1 day')
       AND e.retention_class <= st.max_class`
	case "retire":
		return `e.retire_month >= lay.month(p_now - make_interval(days => st.lag_days))
       AND e.retire_month <= lay.retire(p_now + make_interval(days => st.lookback_days + 1), p_now)`
	}
	return `e.first_seen_month >= lay.month(p_now - make_interval(days => st.lookback_days))
       AND e.first_seen_month <= lay.month(p_now + interval '1 day')`
}

// layoutInsertSQL loads month m's keys into layout l.
func layoutInsertSQL(l layoutDef) string {
	var cols, vals string
	switch l.kind {
	case "base":
		cols, vals = "first_seen_month", "g.first_seen_month"
	case "class":
		cols, vals = "first_seen_month, retention_class", "g.first_seen_month, lay.class_of(g.ttl)"
	case "retire":
		cols, vals = "retire_month, first_seen_month", "lay.retire(g.expires_insert, g.first_seen), g.first_seen_month"
	}
	return fmt.Sprintf(`INSERT INTO %s.events (source, key, %s, event_type, status, attempts, token, lease_expires_at,
  fingerprint, result, first_seen, updated_at, completed_at, expires_at)
SELECT g.source, g.key, %s, 'evt', 'completed', 1, g.token, NULL, g.fingerprint, g.result,
       g.first_seen, g.first_seen + interval '2 seconds', g.first_seen + interval '2 seconds', g.expires_at
  FROM lay.gen($1, $2, $3, $4) g`, l.schema, cols, vals)
}

type layoutBench struct {
	cl   *pgcluster.Cluster
	pool *pgxpool.Pool
	n    int // keys per month
	// per layout
	ret    map[string]*retention
	leaves map[string]int
	sizes  map[string]layoutSize
	plans  map[string]string // per layout: partitions scanned / relations locked by one probe, per source
	notes  []string
}

// retention is what retention cost one layout over the year.
type retention struct {
	dropDur, deleteDur, moveDur time.Duration
	dropWAL, deleteWAL, moveWAL int64
	dropped, deleted, moved     int64
	drops                       int
	vacDur                      time.Duration // VACUUM of the leaves DELETE left dead rows in
	vacWAL                      int64
	months                      []monthRet
}

type monthRet struct {
	dur     time.Duration
	wal     int64
	removed int64
	leaves  int
}

type layoutSize struct {
	stored, live int64
	bytes        int64 // tables + indexes of every leaf
	liveBytes    int64 // the live rows' bytes if they were all that was stored
}

func benchLayout(ctx context.Context, _ *env, o options, _ *table) error {
	n := layoutKeys
	if n == 0 {
		n = 300_000
		if o.full {
			n = 3_000_000
		}
	}
	if layoutClaims == 0 {
		layoutClaims = 1000
	}
	opts := []pgcluster.Option{pgcluster.Setting("autovacuum", "off"),
		pgcluster.Setting("max_locks_per_transaction", "256"), pgcluster.Setting("shared_buffers", "256MB")}
	if !layoutFsyncOff {
		opts = append(opts, pgcluster.Durable())
	}
	cl, err := pgcluster.Start(ctx, opts...)
	if err != nil {
		return fmt.Errorf("start a cluster: %w", err)
	}
	defer cl.Stop()
	cfg, err := pgxpool.ParseConfig(cl.URL("postgres"))
	if err != nil {
		return err
	}
	cfg.ConnConfig.RuntimeParams["timezone"] = "UTC"
	cfg.MaxConns = 12
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	lb := &layoutBench{cl: cl, pool: pool, n: n / layoutMonths,
		ret: map[string]*retention{}, leaves: map[string]int{}, sizes: map[string]layoutSize{}, plans: map[string]string{}}
	start := time.Now()
	if _, err := pool.Exec(ctx, layoutCommon); err != nil {
		return fmt.Errorf("common: %w", err)
	}
	for _, l := range layouts {
		if _, err := pool.Exec(ctx, layoutSchemaSQL(l)); err != nil {
			return fmt.Errorf("%s: %w", l.schema, err)
		}
		lb.ret[l.schema] = &retention{}
	}
	if err := lb.year(ctx); err != nil {
		return err
	}
	if err := lb.steady(ctx); err != nil {
		return err
	}
	cpu, err := lb.claimCPU(ctx)
	if err != nil {
		return fmt.Errorf("claim cpu: %w", err)
	}
	tput, err := lb.claimThroughput(ctx, o.duration)
	if err != nil {
		return fmt.Errorf("claim throughput: %w", err)
	}
	up, err := lb.upgrade(ctx)
	if err != nil {
		return fmt.Errorf("upgrade: %w", err)
	}
	layoutTable = lb.markdown(n, time.Since(start), cpu, tput, up)
	fmt.Fprint(os.Stderr, layoutTable)
	return nil
}

func layMonth(m int) time.Time {
	t, _ := time.Parse("2006-01-02", layoutStart)
	return t.AddDate(0, m, 0)
}

// year loads the 13 months, rotating before each and running retention
// at each one's end.
func (lb *layoutBench) year(ctx context.Context) error {
	for m := 0; m < layoutMonths; m++ {
		for _, l := range layouts {
			if err := lb.rotate(ctx, l, m); err != nil {
				return fmt.Errorf("rotate %s month %d: %w", l.schema, m, err)
			}
			if _, err := lb.pool.Exec(ctx, layoutInsertSQL(l), m, lb.n, layoutTTLChange, layoutExtendEvery); err != nil {
				return fmt.Errorf("load %s month %d: %w", l.schema, m, err)
			}
		}
		if _, err := lb.pool.Exec(ctx, "CHECKPOINT"); err != nil {
			return err
		}
		end := layMonth(m + 1)
		for _, l := range layouts {
			if err := lb.retain(ctx, l, end); err != nil {
				return fmt.Errorf("retention %s at %s: %w", l.schema, end.Format("2006-01"), err)
			}
		}
		fmt.Fprintf(os.Stderr, "layout: month %d done (load %s)\n", m, loadavg())
	}
	return nil
}

func (lb *layoutBench) classesInUse(m int) []int {
	seen := map[int]bool{}
	for _, src := range []string{"forms", "d30", "d60", "d90", "ledger"} {
		seen[classOf(ttlOf(src, m))] = true
	}
	var cs []int
	for c := range seen {
		if c < 6 {
			cs = append(cs, c)
		}
	}
	sort.Ints(cs)
	return cs
}

func ttlOf(src string, m int) int {
	switch src {
	case "forms":
		if layoutTTLChange && m >= 6 {
			return 90
		}
		return 7
	case "d30":
		return 30
	case "d60":
		return 60
	case "d90":
		return 90
	case "ledger":
		if layoutTTLChange && m >= 6 {
			return 30
		}
		return 400
	}
	return 3650
}

var classBounds = []int{8, 35, 65, 95, 190, 400}

func classOf(days int) int {
	for c, b := range classBounds {
		if days <= b {
			return c
		}
	}
	return 6
}

// rotate makes the partitions month m (0 = 2025-01) and the next three
// need, as `partitions rotate --premake 3` would.
func (lb *layoutBench) rotate(ctx context.Context, l layoutDef, m int) error {
	s := l.schema
	var stmts []string
	mk := func(rel, parent, kind string, lo time.Time, class int, due *time.Time, ddl string) {
		var exists bool
		_ = lb.pool.QueryRow(ctx, `SELECT true FROM lay.parts WHERE schema = $1 AND rel = $2`, s, rel).Scan(&exists)
		if exists {
			return
		}
		stmts = append(stmts, ddl)
		var dueS = "NULL"
		if due != nil {
			dueS = "'" + due.Format(time.RFC3339) + "'"
		}
		stmts = append(stmts, fmt.Sprintf(`INSERT INTO lay.parts (schema, rel, parent, kind, lo, class, due) VALUES ('%s', '%s', '%s', '%s', '%s', %d, %s)`,
			s, rel, parent, kind, lo.Format("2006-01-02"), class, dueS))
	}
	switch l.kind {
	case "base", "class":
		for k := m; k <= m+3; k++ {
			lo, hi := layMonth(k), layMonth(k+1)
			rel := fmt.Sprintf("%s.events_%s", s, lo.Format("2006_01"))
			if l.kind == "base" {
				mk(rel, s+".events", "month", lo, -1, &hi, fmt.Sprintf("CREATE TABLE %s PARTITION OF %s.events FOR VALUES FROM ('%s') TO ('%s')", rel, s, lo.Format("2006-01-02"), hi.Format("2006-01-02")))
				continue
			}
			mk(rel, s+".events", "monthparent", lo, -1, nil, fmt.Sprintf("CREATE TABLE %s PARTITION OF %s.events FOR VALUES FROM ('%s') TO ('%s') PARTITION BY RANGE (retention_class)", rel, s, lo.Format("2006-01-02"), hi.Format("2006-01-02")))
			for _, c := range lb.classesInUse(k) {
				due := hi.AddDate(0, 0, classBounds[c])
				mk(fmt.Sprintf("%s_c%d", rel, c), rel, "leaf", lo, c, &due, fmt.Sprintf("CREATE TABLE %s_c%d PARTITION OF %s FOR VALUES FROM (%d) TO (%d)", rel, c, rel, c, c+1))
			}
			mk(rel+"_cx", rel, "classdefault", lo, 6, nil, fmt.Sprintf("CREATE TABLE %s_cx PARTITION OF %s DEFAULT", rel, rel))
		}
	case "retire":
		for k := m; k <= m+layoutHorizon+3; k++ {
			lo, hi := layMonth(k), layMonth(k+1)
			rel := fmt.Sprintf("%s.events_%s", s, lo.Format("2006_01"))
			mk(rel, s+".events", "month", lo, -1, &hi, fmt.Sprintf("CREATE TABLE %s PARTITION OF %s.events FOR VALUES FROM ('%s') TO ('%s')", rel, s, lo.Format("2006-01-02"), hi.Format("2006-01-02")))
		}
	}
	for _, st := range stmts {
		if _, err := lb.pool.Exec(ctx, st); err != nil {
			return fmt.Errorf("%s: %w", st, err)
		}
	}
	return nil
}

type part struct {
	rel, parent, kind string
	lo                time.Time
	class             int
	due               *time.Time
}

func (lb *layoutBench) walLSN(ctx context.Context, c *pgxpool.Conn) (int64, error) {
	var v int64
	err := c.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint`).Scan(&v)
	return v, err
}

// retain is retention at the end of a simulated month (now = t): drop every
// due partition with no live row, DELETE expired rows where the layout
// must, move the live rows of a due partition where the layout does.
func (lb *layoutBench) retain(ctx context.Context, l layoutDef, t time.Time) error {
	c, err := lb.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	rows, err := c.Query(ctx, `SELECT rel, parent, kind, coalesce(lo, '1970-01-01'), coalesce(class, -1), due FROM lay.parts
	 WHERE schema = $1 AND alive AND kind <> 'monthparent' ORDER BY lo NULLS FIRST, class`, l.schema)
	if err != nil {
		return err
	}
	parts, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (part, error) {
		var p part
		err := r.Scan(&p.rel, &p.parent, &p.kind, &p.lo, &p.class, &p.due)
		return p, err
	})
	if err != nil {
		return err
	}
	rt := lb.ret[l.schema]
	var month monthRet
	for _, p := range parts {
		if !p.lo.Before(t) && p.kind != "default" && p.kind != "far" {
			continue // premade, nothing in it yet
		}
		var live bool
		if err := c.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE expires_at > $1)`, p.rel), t).Scan(&live); err != nil {
			return err
		}
		due := p.due != nil && !p.due.After(t)
		if p.kind == "classdefault" {
			due = !p.lo.AddDate(0, 1, 0).After(t) // its month has ended: no row can arrive
		}
		if due && live && l.move && (p.kind == "leaf" || p.kind == "month") {
			w0, _ := lb.walLSN(ctx, c)
			t0 := time.Now()
			n, err := lb.moveLive(ctx, c, l, p, t)
			if err != nil {
				return fmt.Errorf("move %s: %w", p.rel, err)
			}
			d := time.Since(t0)
			w1, _ := lb.walLSN(ctx, c)
			rt.moveDur += d
			rt.moveWAL += w1 - w0
			rt.moved += n
			month.dur += d
			month.wal += w1 - w0
			if err := c.QueryRow(ctx, fmt.Sprintf(`SELECT EXISTS (SELECT 1 FROM %s WHERE expires_at > $1)`, p.rel), t).Scan(&live); err != nil {
				return err
			}
			if live {
				return fmt.Errorf("%s still holds live rows after the move", p.rel)
			}
		}
		if due && !live {
			var cnt int64
			if err := c.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM %s`, p.rel)).Scan(&cnt); err != nil {
				return err
			}
			w0, _ := lb.walLSN(ctx, c)
			t0 := time.Now()
			if _, err := c.Exec(ctx, fmt.Sprintf(`ALTER TABLE %s DETACH PARTITION %s`, p.parent, p.rel)); err != nil {
				return err
			}
			if _, err := c.Exec(ctx, fmt.Sprintf(`DROP TABLE %s`, p.rel)); err != nil {
				return err
			}
			d := time.Since(t0)
			w1, _ := lb.walLSN(ctx, c)
			if _, err := c.Exec(ctx, `UPDATE lay.parts SET alive = false WHERE schema = $1 AND rel = $2`, l.schema, p.rel); err != nil {
				return err
			}
			rt.dropDur += d
			rt.dropWAL += w1 - w0
			rt.dropped += cnt
			rt.drops++
			month.dur += d
			month.wal += w1 - w0
			month.removed += cnt
			continue
		}
		// Not droppable: today's prune deletes expired rows anywhere; A and
		// B delete only where no drop will come (the defaults, the far
		// partition, a class default whose month has ended), and B-lag
		// leaves a due month holding live rows as it is, for a later
		// month's end to drop.
		prune := l.kind == "base" || p.kind == "default" || p.kind == "far" || (p.kind == "classdefault" && due && live)
		if !prune {
			continue
		}
		deletedBefore := rt.deleted
		w0, _ := lb.walLSN(ctx, c)
		t0 := time.Now()
		for {
			tag, err := c.Exec(ctx, fmt.Sprintf(`DELETE FROM %[1]s WHERE ctid = ANY (ARRAY(SELECT ctid FROM %[1]s WHERE expires_at <= $1 LIMIT 5000))`, p.rel), t)
			if err != nil {
				return err
			}
			rt.deleted += tag.RowsAffected()
			month.removed += tag.RowsAffected()
			if tag.RowsAffected() < 5000 {
				break
			}
		}
		d := time.Since(t0)
		w1, _ := lb.walLSN(ctx, c)
		rt.deleteDur += d
		rt.deleteWAL += w1 - w0
		month.dur += d
		month.wal += w1 - w0
		if rt.deleted > deletedBefore {
			// What autovacuum would do next (it is off here so that the
			// WAL of each step is its own): counted apart.
			t0 := time.Now()
			if _, err := c.Exec(ctx, "VACUUM "+p.rel); err != nil {
				return err
			}
			w2, _ := lb.walLSN(ctx, c)
			rt.vacDur += time.Since(t0)
			rt.vacWAL += w2 - w1
		}
	}
	// A: a month whose leaves are all gone goes too.
	if l.kind == "class" {
		if _, err := c.Exec(ctx, `UPDATE lay.parts p SET alive = false WHERE p.schema = $1 AND p.kind = 'monthparent' AND p.alive
		   AND NOT EXISTS (SELECT 1 FROM lay.parts q WHERE q.schema = p.schema AND q.parent = p.rel AND q.alive)`, l.schema); err != nil {
			return err
		}
		rows, err := c.Query(ctx, `SELECT rel FROM lay.parts p WHERE p.schema = $1 AND p.kind = 'monthparent' AND NOT p.alive
		   AND to_regclass(p.rel) IS NOT NULL`, l.schema)
		if err != nil {
			return err
		}
		rels, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, r := range rels {
			t0 := time.Now()
			if _, err := c.Exec(ctx, fmt.Sprintf(`ALTER TABLE %s.events DETACH PARTITION %s`, l.schema, r)); err != nil {
				return err
			}
			if _, err := c.Exec(ctx, fmt.Sprintf(`DROP TABLE %s`, r)); err != nil {
				return err
			}
			rt.dropDur += time.Since(t0)
			month.dur += time.Since(t0)
		}
	}
	if err := c.QueryRow(ctx, `SELECT count(*) FROM pg_partition_tree($1::regclass) WHERE isleaf`, l.schema+".events").Scan(&month.leaves); err != nil {
		return err
	}
	rt.months = append(rt.months, month)
	return nil
}

// moveLive moves the rows of partition p still live at t, each under its
// key's lock, to the partition that covers their expiry now: for A the
// class of the same month, for B the month of expires_at.
func (lb *layoutBench) moveLive(ctx context.Context, c *pgxpool.Conn, l layoutDef, p part, t time.Time) (int64, error) {
	// The partition's own bounds in the WHERE clause, so that the UPDATE
	// (through the parent, which moves the row) reads only p.
	var set, where string
	switch l.kind {
	case "class":
		set = "retention_class = lay.class_of(ceil(extract(epoch FROM e.expires_at - (e.first_seen_month + interval '1 month')) / 86400))"
		where = fmt.Sprintf("e.first_seen_month = '%s' AND e.retention_class = %d", p.lo.Format("2006-01-02"), p.class)
	case "retire":
		set = "retire_month = lay.retire(e.expires_at, $1)"
		where = fmt.Sprintf("e.retire_month = '%s'", p.lo.Format("2006-01-02"))
	}
	var n int64
	err := c.QueryRow(ctx, fmt.Sprintf(`WITH live AS (
	    SELECT source, key, pg_advisory_xact_lock(1768187245, hashtext(source || chr(31) || key)) FROM %[1]s WHERE expires_at > $1),
	  moved AS (UPDATE %[2]s.events e SET %[3]s FROM live
	    WHERE %[4]s AND e.source = live.source AND e.key = live.key AND e.expires_at > $1 RETURNING 1)
	  SELECT count(*) FROM moved`, p.rel, l.schema, set, where), t).Scan(&n)
	return n, err
}

// steady records, at the end of the year, the leaves alive and the sizes,
// and sets each layout's claim settings from its rows, as an upgrade would.
func (lb *layoutBench) steady(ctx context.Context) error {
	end := layMonth(layoutMonths)
	for _, l := range layouts {
		var leaves int
		if err := lb.pool.QueryRow(ctx, `SELECT count(*) FROM pg_partition_tree($1::regclass) WHERE isleaf`, l.schema+".events").Scan(&leaves); err != nil {
			return err
		}
		lb.leaves[l.schema] = leaves
		var sz layoutSize
		if err := lb.pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*), count(*) FILTER (WHERE expires_at > $1),
		   coalesce(sum(pg_column_size(e.*)) FILTER (WHERE expires_at > $1), 0) FROM %s.events e`, l.schema), end).Scan(&sz.stored, &sz.live, &sz.liveBytes); err != nil {
			return err
		}
		if err := lb.pool.QueryRow(ctx, `SELECT coalesce(sum(pg_total_relation_size(relid)), 0) FROM pg_partition_tree($1::regclass) WHERE isleaf`, l.schema+".events").Scan(&sz.bytes); err != nil {
			return err
		}
		lb.sizes[l.schema] = sz
		// Settings: the final ttl, lookback and lag from the stored rows
		// (as an upgrade computes idem.lookbacks), class of the lookback.
		if _, err := lb.pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %[1]s.settings (source, ttl_days, lookback_days, lag_days, max_class)
		  SELECT s.source, lay.ttl(s.source, 12, $1), greatest(lay.ttl(s.source, 12, $1), coalesce(b.lookback, 0)),
		         45, lay.class_of(greatest(lay.ttl(s.source, 12, $1), coalesce(b.lookback, 0)))
		    FROM lay.sources s LEFT JOIN (
		      SELECT source, ceil(max(extract(epoch FROM expires_at - first_seen)) / 86400)::int + 1 AS lookback
		        FROM %[1]s.events GROUP BY source) b ON b.source = s.source`, l.schema), layoutTTLChange); err != nil {
			return err
		}
		if _, err := lb.pool.Exec(ctx, "ANALYZE "+l.schema+".events"); err != nil {
			return err
		}
		// What retention left must be what the data says is live, and the
		// claim must find it: every live row extended past retention or of
		// the 10-year source, and one in 50 of the rest, answers completed
		// (a claim that acquired one would be a duplicate let through).
		var lost, notFound int64
		if err := lb.pool.QueryRow(ctx, fmt.Sprintf(`SELECT (SELECT count(*) FROM generate_series(0, %d) m, lay.gen(m, $1, $2, $4) g WHERE g.expires_at > $3)
		     - (SELECT count(*) FROM %s.events WHERE expires_at > $3)`, layoutMonths-1, l.schema), lb.n, layoutTTLChange, end, layoutExtendEvery).Scan(&lost); err != nil {
			return err
		}
		if lost != 0 {
			return fmt.Errorf("%s: %d live rows missing after retention", l.schema, lost)
		}
		if err := lb.pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM (
		    SELECT (SELECT outcome FROM %[1]s.claim(e.source, e.key, $2)) AS o FROM %[1]s.events e
		     WHERE e.expires_at > $1 AND (extract(epoch FROM e.expires_at - e.first_seen) / 86400 NOT IN (lay.ttl(e.source, 0, $3), lay.ttl(e.source, 12, $3))
		           OR e.source = 'archive' OR hashtext(e.key) %% 50 = 0)) x
		  WHERE o IS DISTINCT FROM 'completed'`, l.schema), end, claimNow(), layoutTTLChange).Scan(&notFound); err != nil {
			return err
		}
		if notFound != 0 {
			return fmt.Errorf("%s: the claim did not find %d live rows", l.schema, notFound)
		}
		plan, err := lb.probePlan(ctx, l)
		if err != nil {
			return fmt.Errorf("probe plan %s: %w", l.schema, err)
		}
		lb.plans[l.schema] = plan
	}
	return nil
}

// probePlan runs the layout's probe as a generic plan once per source, in
// a transaction, and counts the partitions it scanned (EXPLAIN ANALYZE)
// and the relations the transaction then holds locks on (PostgreSQL 15
// locks every partition of a generic plan at executor start).
func (lb *layoutBench) probePlan(ctx context.Context, l layoutDef) (string, error) {
	c, err := lb.pool.Acquire(ctx)
	if err != nil {
		return "", err
	}
	defer c.Release()
	r := strings.NewReplacer("p_source", "$1", "p_key", "$2", "p_now", "$3", "st.lookback_days", "$4", "st.lag_days", "$5", "st.max_class", "$6")
	q := fmt.Sprintf(`PREPARE layout_probe (text, text, timestamptz, int, int, smallint) AS
	  SELECT e.status FROM %s.events e WHERE e.source = $1 AND e.key = $2 AND %s AND e.expires_at > $3 LIMIT 1`,
		l.schema, r.Replace(layoutProbe(l.kind)))
	if _, err := c.Exec(ctx, `SET plan_cache_mode = force_generic_plan`); err != nil {
		return "", err
	}
	defer c.Exec(context.Background(), `DEALLOCATE layout_probe; RESET plan_cache_mode`) //nolint:errcheck
	if _, err := c.Exec(ctx, q); err != nil {
		return "", err
	}
	var out []string
	for i, src := range append([]string{"warm"}, append(claimSources, "archive")...) {
		if i == 0 {
			src = "ledger" // the first execution builds the generic plan, which locks more
		}
		tx, err := c.Begin(ctx)
		if err != nil {
			return "", err
		}
		var lookback, lag, class int
		if err := tx.QueryRow(ctx, fmt.Sprintf(`SELECT lookback_days, lag_days, max_class FROM %s.settings WHERE source = $1`, l.schema), src).Scan(&lookback, &lag, &class); err != nil {
			tx.Rollback(ctx) //nolint:errcheck
			return "", err
		}
		rows, err := tx.Query(ctx, fmt.Sprintf(`EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) EXECUTE layout_probe ('%s', 'absent', '%s', %d, %d, %d)`,
			src, claimNow().Format(time.RFC3339), lookback, lag, class))
		if err != nil {
			tx.Rollback(ctx) //nolint:errcheck
			return "", err
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			tx.Rollback(ctx) //nolint:errcheck
			return "", err
		}
		scans := 0
		for _, ln := range lines {
			if strings.Contains(ln, "Scan") && strings.Contains(ln, " on ") {
				scans++
			}
		}
		var locks int
		if err := tx.QueryRow(ctx, `SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() AND locktype = 'relation'
		    AND relation IN (SELECT oid FROM pg_class WHERE relnamespace = $1::regnamespace)`, l.schema).Scan(&locks); err != nil {
			tx.Rollback(ctx) //nolint:errcheck
			return "", err
		}
		tx.Rollback(ctx) //nolint:errcheck
		if i > 0 {
			out = append(out, fmt.Sprintf("%s %d/%d", src, scans, locks))
		}
	}
	return strings.Join(out, ", "), nil
}

// claimNow is the simulated clock of the claims: the last hour of the
// year's last month, so that every layout inserts into partitions a month
// of claims has filled (today's current month, A's current month's
// classes, B's months of expiry), on the steady-state partitions.
func claimNow() time.Time { return layMonth(layoutMonths).Add(-time.Hour) }

var claimSources = []string{"forms", "d30", "d60", "d90", "ledger"}

// backendCPU is the CPU time the backend pid has used (utime + stime).
func backendCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("unreadable /proc stat")
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return 0, errors.New("short /proc stat")
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+st) * time.Second / 100, nil // USER_HZ is 100 on Linux
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	return strings.Fields(string(b))[0]
}

type cpuRun struct {
	newUS, dupUS   float64 // server CPU per claim transaction
	newWall, dupWL float64 // wall per claim, one client
	load           string
}

// claimCPU runs, for each layout in turn (3 interleaved rounds), layoutClaims
// new-key claims and as many duplicates from one connection, each its own
// transaction, and reads the backend's CPU from /proc.
func (lb *layoutBench) claimCPU(ctx context.Context) (map[string][]cpuRun, error) {
	out := map[string][]cpuRun{}
	now := claimNow()
	for round := 0; round < 3; round++ {
		for _, l := range layouts {
			c, err := lb.pool.Acquire(ctx)
			if err != nil {
				return nil, err
			}
			var pid int
			if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
				c.Release()
				return nil, err
			}
			q := fmt.Sprintf(`SELECT outcome FROM %s.claim($1, $2, $3)`, l.schema)
			var outcome string
			// Warm the plan and the catalog caches.
			for i := 0; i < 20; i++ {
				if err := c.QueryRow(ctx, q, claimSources[i%5], fmt.Sprintf("warm-%d-%d", round, i), now).Scan(&outcome); err != nil {
					c.Release()
					return nil, err
				}
			}
			var r cpuRun
			r.load = loadavg()
			for phase := 0; phase < 2; phase++ {
				c0, err := backendCPU(pid)
				if err != nil {
					c.Release()
					return nil, err
				}
				t0 := time.Now()
				for i := 0; i < layoutClaims; i++ {
					if err := c.QueryRow(ctx, q, claimSources[i%5], fmt.Sprintf("cpu-%d-%d", round, i), now).Scan(&outcome); err != nil {
						c.Release()
						return nil, err
					}
					want := "acquired"
					if phase == 1 {
						want = "in_progress"
					}
					if outcome != want {
						c.Release()
						return nil, fmt.Errorf("%s: claim %d of phase %d answered %s, want %s", l.schema, i, phase, outcome, want)
					}
				}
				wall := time.Since(t0)
				c1, _ := backendCPU(pid)
				us := float64((c1 - c0).Microseconds()) / float64(layoutClaims)
				w := float64(wall.Microseconds()) / float64(layoutClaims)
				if phase == 0 {
					r.newUS, r.newWall = us, w
				} else {
					r.dupUS, r.dupWL = us, w
				}
			}
			c.Release()
			out[l.schema] = append(out[l.schema], r)
			fmt.Fprintf(os.Stderr, "layout: cpu %s round %d: new %.0f us, dup %.0f us (load %s)\n", l.schema, round, r.newUS, r.dupUS, r.load)
		}
	}
	return out, nil
}

type tputRun struct {
	newRate, dupRate float64 // claims/s, 8 clients
	newCPU, dupCPU   float64 // server CPU per claim over the 8 backends
	load             string
}

// claimThroughput runs 8 clients for d on new keys, then on duplicates of
// them, per layout, 3 interleaved rounds.
func (lb *layoutBench) claimThroughput(ctx context.Context, d time.Duration) (map[string][]tputRun, error) {
	const clients = 8
	out := map[string][]tputRun{}
	now := claimNow()
	for round := 0; round < 3; round++ {
		for _, l := range layouts {
			q := fmt.Sprintf(`SELECT outcome FROM %s.claim($1, $2, $3)`, l.schema)
			conns := make([]*pgx.Conn, clients)
			pids := make([]int, clients)
			for i := range conns {
				cfg := lb.pool.Config().ConnConfig.Copy()
				c, err := pgx.ConnectConfig(ctx, cfg)
				if err != nil {
					return nil, err
				}
				conns[i] = c
				if err := c.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pids[i]); err != nil {
					return nil, err
				}
			}
			var r tputRun
			r.load = loadavg()
			counts := make([]int, clients)
			for phase := 0; phase < 2; phase++ {
				var cpu0 time.Duration
				for _, p := range pids {
					v, _ := backendCPU(p)
					cpu0 += v
				}
				var total atomic.Int64
				var wg sync.WaitGroup
				errs := make(chan error, clients)
				deadline := time.Now().Add(d)
				for i := range conns {
					wg.Add(1)
					go func(i int) {
						defer wg.Done()
						var outcome string
						for k := 0; ; k++ {
							if phase == 0 && time.Now().After(deadline) {
								counts[i] = k
								return
							}
							if phase == 1 && (time.Now().After(deadline) || counts[i] == 0) {
								return
							}
							kk := k
							if phase == 1 {
								kk = k % counts[i]
							}
							if err := conns[i].QueryRow(ctx, q, claimSources[kk%5], fmt.Sprintf("tp-%d-%d-%d", round, i, kk), now).Scan(&outcome); err != nil {
								errs <- err
								return
							}
							total.Add(1)
						}
					}(i)
				}
				wg.Wait()
				close(errs)
				if err := <-errs; err != nil {
					return nil, err
				}
				var cpu1 time.Duration
				for _, p := range pids {
					v, _ := backendCPU(p)
					cpu1 += v
				}
				rate := float64(total.Load()) / d.Seconds()
				us := float64((cpu1 - cpu0).Microseconds()) / float64(max(total.Load(), 1))
				if phase == 0 {
					r.newRate, r.newCPU = rate, us
				} else {
					r.dupRate, r.dupCPU = rate, us
				}
			}
			for _, c := range conns {
				c.Close(ctx)
			}
			out[l.schema] = append(out[l.schema], r)
			fmt.Fprintf(os.Stderr, "layout: 8 clients %s round %d: new %.0f/s (%.0f us cpu), dup %.0f/s (%.0f us cpu) (load %s)\n",
				l.schema, round, r.newRate, r.newCPU, r.dupRate, r.dupCPU, r.load)
		}
	}
	return out, nil
}

type upStep struct {
	name  string
	dur   time.Duration
	locks string
}

// upgrade prototypes the online upgrade of today's tree (lay_base, with
// the year's data) to B: a constant-default retire_month column, a CHECK
// added NOT VALID and validated, the new primary key's index built on
// each leaf concurrently, and today's whole tree attached under a new
// parent partitioned by retire_month as one legacy partition. Each step
// that can run in a transaction reports the locks it held at its end.
func (lb *layoutBench) upgrade(ctx context.Context) ([]upStep, error) {
	c, err := lb.pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer c.Release()
	files := func() (map[string]uint32, error) {
		rows, err := c.Query(ctx, `SELECT relid::text, pg_relation_filenode(relid) FROM pg_partition_tree('lay_base.events') WHERE isleaf`)
		if err != nil {
			return nil, err
		}
		m := map[string]uint32{}
		for rows.Next() {
			var r string
			var f uint32
			if err := rows.Scan(&r, &f); err != nil {
				return nil, err
			}
			m[r] = f
		}
		return m, rows.Err()
	}
	before, err := files()
	if err != nil {
		return nil, err
	}
	var steps []upStep
	inTx := func(name string, stmts ...string) error {
		t0 := time.Now()
		tx, err := c.Begin(ctx)
		if err != nil {
			return err
		}
		defer tx.Rollback(ctx)
		for _, s := range stmts {
			if _, err := tx.Exec(ctx, s); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
		}
		var locks string
		if err := tx.QueryRow(ctx, `SELECT coalesce(string_agg(m, '; ' ORDER BY m), '') FROM (
		    SELECT l.mode || ' on ' || count(*) FILTER (WHERE c.relkind = 'p') || ' partitioned, '
		           || count(*) FILTER (WHERE c.relkind = 'r') || ' leaves' AS m
		      FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
		     WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' AND c.relkind IN ('r', 'p')
		       AND c.relnamespace::regnamespace::text IN ('lay_base', 'lay_up')
		     GROUP BY l.mode) x`).Scan(&locks); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return err
		}
		steps = append(steps, upStep{name, time.Since(t0), locks})
		return nil
	}
	if err := inTx("add retire_month, constant default (no rewrite)",
		`ALTER TABLE lay_base.events ADD COLUMN retire_month date NOT NULL DEFAULT '1970-01-01'`); err != nil {
		return nil, err
	}
	if err := inTx("add CHECK (retire_month < 1970-02-01) NOT VALID on each leaf",
		`DO $$ DECLARE r regclass; BEGIN
		   FOR r IN SELECT relid FROM pg_partition_tree('lay_base.events') WHERE isleaf LOOP
		     EXECUTE format('ALTER TABLE %s ADD CONSTRAINT legacy_retire CHECK (retire_month < date ''1970-02-01'') NOT VALID', r);
		   END LOOP; END $$`); err != nil {
		return nil, err
	}
	if err := inTx("validate the CHECK on each leaf (scans every row)",
		`DO $$ DECLARE r regclass; BEGIN
		   FOR r IN SELECT relid FROM pg_partition_tree('lay_base.events') WHERE isleaf LOOP
		     EXECUTE format('ALTER TABLE %s VALIDATE CONSTRAINT legacy_retire', r);
		   END LOOP; END $$`); err != nil {
		return nil, err
	}
	// First way: a new parent with no key of its own (each retire month
	// has its own primary key; a claim's ON CONFLICT DO NOTHING without a
	// target checks every unique index of the leaf it inserts into), so
	// today's tree attaches as it is.
	if err := inTx("create the new parent by retire_month, no parent key",
		`CREATE SCHEMA lay_up`,
		`CREATE TABLE lay_up.events (LIKE lay_base.events INCLUDING DEFAULTS) PARTITION BY RANGE (retire_month)`); err != nil {
		return nil, err
	}
	if err := inTx("1: attach today's tree as the legacy partition [MINVALUE, 1970-02-01)",
		`ALTER TABLE lay_up.events ATTACH PARTITION lay_base.events FOR VALUES FROM (MINVALUE) TO ('1970-02-01')`); err != nil {
		return nil, err
	}
	if err := inTx("1: make a retire month beside it, its own key",
		`CREATE TABLE lay_up.events_2026_02 PARTITION OF lay_up.events FOR VALUES FROM ('2026-02-01') TO ('2026-03-01')`,
		`ALTER TABLE lay_up.events_2026_02 ADD PRIMARY KEY (source, key, retire_month)`); err != nil {
		return nil, err
	}
	var found1 int
	if err := c.QueryRow(ctx, `SELECT count(*) FROM lay_up.events WHERE retire_month >= '1970-01-01' AND retire_month < '1970-02-01'`).Scan(&found1); err != nil {
		return nil, err
	}
	if err := inTx("(undo 1 to try 2: detach the legacy partition)",
		`ALTER TABLE lay_up.events DETACH PARTITION lay_base.events`); err != nil {
		return nil, err
	}
	// Second way: a key on the new parent, which today's tree must match:
	// its index built concurrently on each leaf, then attached.
	t0 := time.Now()
	rows, err := c.Query(ctx, `SELECT relid::text FROM pg_partition_tree('lay_base.events') WHERE isleaf`)
	if err != nil {
		return nil, err
	}
	leaves, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, err
	}
	for i, leaf := range leaves {
		if _, err := c.Exec(ctx, fmt.Sprintf(`CREATE UNIQUE INDEX CONCURRENTLY legacy_key_%d ON %s (source, key, retire_month, first_seen_month)`, i, leaf)); err != nil {
			return nil, fmt.Errorf("index %s: %w", leaf, err)
		}
	}
	steps = append(steps, upStep{"2: unique (source, key, retire_month, first_seen_month) CONCURRENTLY on each leaf", time.Since(t0), "SHARE UPDATE EXCLUSIVE on each leaf in turn (CONCURRENTLY)"})
	attachIdx := []string{`CREATE UNIQUE INDEX legacy_key ON ONLY lay_base.events (source, key, retire_month, first_seen_month)`}
	for i, leaf := range leaves {
		attachIdx = append(attachIdx, fmt.Sprintf(`ALTER INDEX lay_base.legacy_key ATTACH PARTITION %s.legacy_key_%d`, strings.Split(leaf, ".")[0], i))
	}
	if err := inTx("2: attach the leaves' indexes to one on today's parent", attachIdx...); err != nil {
		return nil, err
	}
	if err := inTx("2: a key on the new parent",
		`ALTER TABLE lay_up.events_2026_02 DROP CONSTRAINT events_2026_02_pkey`,
		`ALTER TABLE lay_up.events ADD CONSTRAINT events_key UNIQUE (source, key, retire_month, first_seen_month)`); err != nil {
		return nil, err
	}
	if err := inTx("2: attach today's tree as the legacy partition [MINVALUE, 1970-02-01)",
		`ALTER TABLE lay_up.events ATTACH PARTITION lay_base.events FOR VALUES FROM (MINVALUE) TO ('1970-02-01')`); err != nil {
		return nil, err
	}
	after, err := files()
	if err != nil {
		return nil, err
	}
	moved := 0
	for r, f := range before {
		if after[r] != f {
			moved++
		}
	}
	var found int
	if err := c.QueryRow(ctx, `SELECT count(*) FROM lay_up.events WHERE retire_month >= '1970-01-01' AND retire_month < '1970-02-01'`).Scan(&found); err != nil {
		return nil, err
	}
	lb.notes = append(lb.notes, fmt.Sprintf("Upgrade: %d of %d leaves rewritten (relfilenode changed); legacy rows read through the new parent: %d (1), %d (2).", moved, len(before), found1, found))
	return steps, nil
}

// medianRange is "median (min..max)" of xs.
func medianRange(xs []float64) string {
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s) == 0 {
		return ""
	}
	return fmt.Sprintf("%.0f (%.0f..%.0f)", median(s), s[0], s[len(s)-1])
}

func (lb *layoutBench) markdown(n int, took time.Duration, cpu map[string][]cpuRun, tput map[string][]tputRun, up []upStep) string {
	var w strings.Builder
	server := "durable server"
	if layoutFsyncOff {
		server = "fsync off"
	}
	fmt.Fprintf(&w, "### Retention layouts compared: %d keys over %d simulated months, %s, autovacuum off (took %s, %s)\n\n",
		n, layoutMonths, server, took.Round(time.Second), time.Now().UTC().Format(time.RFC3339))
	extended := "none"
	if layoutExtendEvery > 0 {
		extended = fmt.Sprintf("1 in %d", layoutExtendEvery)
	}
	fmt.Fprintf(&w, "ttl change at month 6 (forms 7 -> 90, ledger 400 -> 30): %v; rows extended 45 days past retention: %s; 0.1%% archive rows with a 10-year ttl.\n\n", layoutTTLChange, extended)
	w.WriteString("Retention over the year (every month's end): expired rows removed, time and WAL per row.\n\n")
	w.WriteString("| layout | rows dropped | us/row | B WAL/row | rows deleted | us/row | B WAL/row | rows moved | us/row | B WAL/row | all: us/row | all: B WAL/row | drops | then VACUUM: us, B WAL per deleted row |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	per := func(d time.Duration, n int64) string {
		if n == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", float64(d.Microseconds())/float64(n))
	}
	perB := func(b, n int64) string {
		if n == 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", float64(b)/float64(n))
	}
	for _, l := range layouts {
		r := lb.ret[l.schema]
		all := r.dropped + r.deleted
		fmt.Fprintf(&w, "| %s | %d | %s | %s | %d | %s | %s | %d | %s | %s | %s | %s | %d | %s, %s |\n", l.name,
			r.dropped, per(r.dropDur, r.dropped), perB(r.dropWAL, r.dropped),
			r.deleted, per(r.deleteDur, r.deleted), perB(r.deleteWAL, r.deleted),
			r.moved, per(r.moveDur, r.moved), perB(r.moveWAL, r.moved),
			per(r.dropDur+r.deleteDur+r.moveDur, all), perB(r.dropWAL+r.deleteWAL+r.moveWAL, all), r.drops,
			per(r.vacDur, r.deleted), perB(r.vacWAL, r.deleted))
	}
	w.WriteString("\nPer month's end: retention time (ms) / WAL (kB) / rows removed / leaves after.\n\n| month end |")
	for _, l := range layouts {
		fmt.Fprintf(&w, " %s |", l.schema)
	}
	w.WriteString("\n|---|" + strings.Repeat("---|", len(layouts)) + "\n")
	for m := 0; m < layoutMonths; m++ {
		fmt.Fprintf(&w, "| %s |", layMonth(m+1).Format("2006-01"))
		for _, l := range layouts {
			mr := lb.ret[l.schema].months[m]
			fmt.Fprintf(&w, " %.0f / %.0f / %d / %d |", float64(mr.dur.Microseconds())/1000, float64(mr.wal)/1024, mr.removed, mr.leaves)
		}
		w.WriteString("\n")
	}
	w.WriteString("\nAt the end of the year: leaves alive, stored vs live rows, tables + indexes.\n\n| layout | leaves | stored rows | live rows | stored/live | MB (tables + indexes) | MB / live MB |\n|---|---|---|---|---|---|---|\n")
	for _, l := range layouts {
		s := lb.sizes[l.schema]
		fmt.Fprintf(&w, "| %s | %d | %d | %d | %.2f | %.1f | %.2f |\n", l.name, lb.leaves[l.schema], s.stored, s.live,
			float64(s.stored)/float64(max(s.live, 1)), float64(s.bytes)/1e6, float64(s.bytes)/float64(max(s.liveBytes, 1)))
	}
	w.WriteString("\nOne probe of the window (the claim's SELECT, generic plan, a key that is absent), per source: partitions scanned / relations (tables and indexes) locked.\n\n| layout | leaves | source scanned/locked |\n|---|---|---|\n")
	for _, l := range layouts {
		fmt.Fprintf(&w, "| %s | %d | %s |\n", l.name, lb.leaves[l.schema], lb.plans[l.schema])
	}
	w.WriteString("\nThe minimal claim on the steady-state partitions: server CPU per claim transaction (backend /proc, one client, " +
		strconv.Itoa(layoutClaims) + " claims, median (min..max) of 3 interleaved rounds), and 8 clients.\n\n")
	w.WriteString("| layout | leaves | new: CPU us | dup: CPU us | new: x today | dup: x today | new: wall us | 8 clients new/s | CPU us | 8 clients dup/s | CPU us | load |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, l := range layouts {
		var nu, du, nw, nr, nc, dr, dc []float64
		var loads []string
		for _, r := range cpu[l.schema] {
			nu, du, nw = append(nu, r.newUS), append(du, r.dupUS), append(nw, r.newWall)
			loads = append(loads, r.load)
		}
		for _, r := range tput[l.schema] {
			nr, nc, dr, dc = append(nr, r.newRate), append(nc, r.newCPU), append(dr, r.dupRate), append(dc, r.dupCPU)
			loads = append(loads, r.load)
		}
		// The ratio to today's layout in the same round (the rounds are
		// interleaved, so a load that changed between rounds cancels out).
		var rn, rd []float64
		for i, r := range cpu[l.schema] {
			if b := cpu["lay_base"]; i < len(b) && b[i].newUS > 0 && b[i].dupUS > 0 {
				rn, rd = append(rn, r.newUS/b[i].newUS), append(rd, r.dupUS/b[i].dupUS)
			}
		}
		ratio := func(xs []float64) string {
			s := append([]float64(nil), xs...)
			sort.Float64s(s)
			if len(s) == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2f (%.2f..%.2f)", median(s), s[0], s[len(s)-1])
		}
		fmt.Fprintf(&w, "| %s | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", l.name, lb.leaves[l.schema],
			medianRange(nu), medianRange(du), ratio(rn), ratio(rd), medianRange(nw), medianRange(nr), medianRange(nc), medianRange(dr), medianRange(dc), strings.Join(loads, " "))
	}
	w.WriteString("\nOnline upgrade of today's tree (lay_base, the year's data) to B, each step's time and the locks it held.\n\n| step | time | locks held at its end |\n|---|---|---|\n")
	for _, s := range up {
		fmt.Fprintf(&w, "| %s | %s | %s |\n", s.name, s.dur.Round(100*time.Microsecond), s.locks)
	}
	w.WriteString("\n")
	for _, n := range lb.notes {
		w.WriteString(n + "\n\n")
	}
	return w.String()
}
