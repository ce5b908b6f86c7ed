package idem_test

import (
	"context"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// keyState names the state of key k of source s at the session's clock,
// as docs/design.md's state diagram names it: from its row in
// idem.processed_events (status, lease, retryable, expiry) and its row in
// idem.holds (the inbox's state).
const keyState = `
SELECT CASE
         WHEN h.state = 'dead'   THEN 'dead'
         WHEN h.state = 'queued' THEN 'held'
         WHEN e.status IS NULL OR e.expires_at <= idem.clock() THEN 'absent'
         WHEN e.status = 'processing' AND e.lease_expires_at > idem.clock() THEN 'processing'
         WHEN e.status = 'processing' THEN 'lease_lost'
         WHEN e.status = 'completed' THEN 'completed'
         WHEN e.status = 'failed' AND e.retryable THEN 'failed_retryable'
         WHEN e.status = 'failed' THEN 'failed'
       END
  FROM (SELECT 1) one
  LEFT JOIN LATERAL (SELECT * FROM idem.processed_events x WHERE x.source = $1 AND x.key = $2
                      ORDER BY x.first_seen_month DESC LIMIT 1) e ON true
  LEFT JOIN idem.holds h ON h.source = $1 AND h.key = $2`

// transition is one edge of the diagram as the code runs it: from a key in
// state from, the call (an SQL expression whose value is the call's answer,
// over s the source, k the key, tok the key's token and job the inbox
// job's token) answers outcome and leaves the key in state to. later moves
// the clock first.
type transition struct {
	from, to, label string
	later           time.Duration
	call, outcome   string
}

// The key's life, as docs/design.md draws it. Labels are the diagram's.
var transitions = []transition{
	{"absent", "processing", "claim → acquired", 0, `(SELECT outcome FROM idem.claim(s, k))`, "acquired"},
	{"absent", "completed", "adopt_key (a key the legacy table processed)", 0, `(SELECT 'adopted' FROM idem.adopt_key((SELECT max(id) FROM idem.adoptions), k, idem.clock(), idem.utc_month(idem.clock()) - 400, idem.utc_month(idem.clock())))`, "adopted"},
	{"processing", "processing", "claim → in_progress", 0, `(SELECT outcome FROM idem.claim(s, k))`, "in_progress"},
	{"processing", "processing", "extend → extended", 0, `(SELECT outcome FROM idem.extend(s, k, tok))`, "extended"},
	{"processing", "completed", "complete → completed", 0, `idem.complete(s, k, tok, '{"ok": true}')`, "completed"},
	{"processing", "failed_retryable", "fail(retryable) → failed", 0, `idem.fail(s, k, tok, 'boom', true)`, "failed"},
	{"processing", "failed", "fail(not retryable) → failed", 0, `idem.fail(s, k, tok, 'boom', false)`, "failed"},
	{"processing", "lease_lost", "the lease runs out", 2 * time.Minute, `'later'`, "later"},
	{"processing", "held", "queue_hold (the inbox accepts)", 0, `coalesce(idem.queue_hold(s, k, tok, 1)::text, 'held')`, "held"},
	{"lease_lost", "processing", "claim → acquired (next attempt)", 0, `(SELECT outcome FROM idem.claim(s, k))`, "acquired"},
	{"lease_lost", "failed", "claim → failed (max_attempts reached)", 0, `(SELECT outcome FROM idem.claim('max1', k))`, "failed"},
	{"lease_lost", "absent", "release", 0, `idem.release(s, k)`, "1"},
	{"failed_retryable", "processing", "claim → acquired (next attempt)", 0, `(SELECT outcome FROM idem.claim(s, k))`, "acquired"},
	{"failed_retryable", "failed", "claim → failed (max_attempts reached)", 0, `(SELECT outcome FROM idem.claim('max1', k))`, "failed"},
	{"failed_retryable", "absent", "release", 0, `idem.release(s, k)`, "1"},
	{"completed", "completed", "claim → completed", 0, `(SELECT outcome FROM idem.claim(s, k))`, "completed"},
	{"completed", "completed", "claim with another fingerprint → mismatch", 0, `(SELECT outcome FROM idem.claim(s, k, fingerprint => 'other'))`, "mismatch"},
	{"completed", "absent", "release", 0, `idem.release(s, k)`, "1"},
	{"completed", "absent", "expiry (ttl)", 31 * 24 * time.Hour, `'later'`, "later"},
	{"failed", "failed", "claim → failed", 0, `(SELECT outcome FROM idem.claim(s, k))`, "failed"},
	{"failed", "absent", "release", 0, `idem.release(s, k)`, "1"},
	{"failed", "absent", "expiry (ttl)", 31 * 24 * time.Hour, `'later'`, "later"},
	{"held", "held", "claim → in_progress", 0, `(SELECT outcome FROM idem.claim(s, k))`, "in_progress"},
	{"held", "held", "queue_fail → failed (River retries the job)", 0, `idem.queue_fail(s, k, job, tok, 'boom', false)`, "failed"},
	{"held", "completed", "queue_complete → completed", 0, `idem.queue_complete(s, k, job, tok, '{"ok": true}')`, "completed"},
	{"held", "dead", "queue_fail(dead) → dead", 0, `idem.queue_fail(s, k, job, tok, 'boom', true)`, "dead"},
	{"dead", "dead", "claim → acquired (the dead letter stays)", 0, `(SELECT outcome FROM idem.claim(s, k))`, "acquired"},
	{"dead", "held", "queue_replay → acquired, then queue_hold", 0, `(SELECT r.outcome || ',' || idem.queue_hold(s, k, r.token, 2) FROM idem.queue_replay(s, k, job) r)`, "acquired,1"},
}

// reach brings key k of source s to state, through the calls the code
// offers, and returns the key's token and the inbox job's token (0 when
// there is none).
func reach(t *testing.T, ctx context.Context, conn *pgx.Conn, s, k, state string) (token, job int64) {
	t.Helper()
	q := func(sql string, args ...any) string {
		t.Helper()
		var out string
		if err := conn.QueryRow(ctx, sql, args...).Scan(&out); err != nil {
			t.Fatalf("reach %s: %s: %v", state, sql, err)
		}
		return out
	}
	if state == "absent" {
		return 0, 0
	}
	if err := conn.QueryRow(ctx, `SELECT token FROM idem.claim($1, $2, fingerprint => 'f', lease => '1 minute')`, s, k).Scan(&token); err != nil {
		t.Fatalf("reach %s: claim: %v", state, err)
	}
	switch state {
	case "processing":
	case "lease_lost":
		advance(t, ctx, conn, 2*time.Minute)
	case "completed":
		q(`SELECT idem.complete($1, $2, $3, '{}')`, s, k, token)
	case "failed_retryable":
		q(`SELECT idem.fail($1, $2, $3, 'x', true)`, s, k, token)
	case "failed":
		q(`SELECT idem.fail($1, $2, $3, 'x', false)`, s, k, token)
	case "held", "dead":
		job = token
		q(`SELECT coalesce(idem.queue_hold($1, $2, $3, 1)::text, '')`, s, k, job)
		if err := conn.QueryRow(ctx, `SELECT token FROM idem.queue_take($1, $2, $3, 1, '1 minute')`, s, k, job).Scan(&token); err != nil || token == 0 {
			t.Fatalf("reach %s: queue_take: %v", state, err)
		}
		if state == "dead" {
			q(`SELECT idem.queue_fail($1, $2, $3, $4, 'x', true)`, s, k, job, token)
		}
	default:
		t.Fatalf("reach: no way to state %q", state)
	}
	return token, job
}

// advance moves the session's clock (idem.clock(), the test clock) by d.
func advance(t *testing.T, ctx context.Context, conn *pgx.Conn, d time.Duration) {
	t.Helper()
	if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', (idem.clock() + $1::interval)::text, false)`, d.String()); err != nil {
		t.Fatal(err)
	}
}

// TestDesignStateDiagram: docs/design.md's state diagram of a key is the
// code's. Its states are the ones keyState tells apart, which are every
// status idem.processed_events allows and every state of idem.holds; its
// transitions are exactly the table above, and each of them, run against
// the real functions, answers the outcome its label names and leaves the
// key in the state the arrow points to.
func TestDesignStateDiagram(t *testing.T) {
	ctx := context.Background()
	url := testdb.New(t)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', '2026-06-15 12:00:00Z', false);
		INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('max1', '30 days', '1 minute', 1);
		CREATE TABLE public.legacy (k text PRIMARY KEY, at timestamptz NOT NULL);
		INSERT INTO public.legacy VALUES ('adopted', '2026-06-10 00:00:00Z')`); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, `SELECT idem.adopt_start('s', 'public.legacy', 'k', 'at')`); err != nil {
		t.Fatal(err)
	}

	// The diagram as docs/design.md draws it.
	doc, err := os.ReadFile("docs/design.md")
	if err != nil {
		t.Fatal(err)
	}
	block, ok := mermaidStateDiagram(string(doc))
	if !ok {
		t.Fatal("docs/design.md has no ```mermaid stateDiagram-v2 block")
	}
	edge := regexp.MustCompile(`^\s*(\[\*\]|\w+)\s*-->\s*(\[\*\]|\w+)\s*(?::\s*(.+?))?\s*$`)
	var drawn, coded []string
	states := map[string]bool{}
	for _, line := range strings.Split(block, "\n") {
		m := edge.FindStringSubmatch(line)
		if m == nil || m[1] == "[*]" || m[2] == "[*]" {
			continue
		}
		drawn = append(drawn, m[1]+" --> "+m[2]+" : "+m[3])
		states[m[1]], states[m[2]] = true, true
	}
	for _, tr := range transitions {
		coded = append(coded, tr.from+" --> "+tr.to+" : "+tr.label)
	}
	sort.Strings(drawn)
	sort.Strings(coded)
	for _, d := range drawn {
		if !slices.Contains(coded, d) {
			t.Errorf("docs/design.md draws %q, which this test does not run", d)
		}
	}
	for _, c := range coded {
		if !slices.Contains(drawn, c) {
			t.Errorf("docs/design.md does not draw %q", c)
		}
	}

	// Every status and hold state the tables allow is drawn.
	rows, err := conn.Query(ctx, `
		SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c
		 WHERE c.conrelid IN ('idem.processed_events'::regclass, 'idem.holds'::regclass) AND c.contype = 'c'
		   AND (pg_get_constraintdef(c.oid) LIKE '%status%' OR pg_get_constraintdef(c.oid) LIKE '%state%')`)
	if err != nil {
		t.Fatal(err)
	}
	defs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(defs) != 2 {
		t.Fatalf("the status and state checks: %v (%v)", defs, err)
	}
	allowed := regexp.MustCompile(`'(\w+)'::text`)
	stateOf := map[string]string{"processing": "processing", "completed": "completed", "failed": "failed", "queued": "held", "dead": "dead"}
	for _, def := range defs {
		for _, m := range allowed.FindAllStringSubmatch(def, -1) {
			s, ok := stateOf[m[1]]
			if !ok || !states[s] {
				t.Errorf("the value %q the table allows (%s) is not a state of the diagram", m[1], def)
			}
		}
	}

	// Each transition, run.
	for i, tr := range transitions {
		src, key := "s", "k"+strings.Repeat("x", i)
		if tr.from == "absent" && tr.to == "completed" {
			key = "adopted"
		}
		if strings.Contains(tr.call, "'max1'") {
			src = "max1"
		}
		token, job := reach(t, ctx, conn, src, key, tr.from)
		var got string
		if err := conn.QueryRow(ctx, keyState, src, key).Scan(&got); err != nil || got != tr.from {
			t.Fatalf("%s: reached %q (%v), want %q", tr.label, got, err, tr.from)
		}
		if tr.later > 0 {
			advance(t, ctx, conn, tr.later)
		}
		var outcome string
		if err := conn.QueryRow(ctx, `SELECT coalesce((`+tr.call+`)::text, 'NULL')
		                                FROM (SELECT $1::text AS s, $2::text AS k, $3::bigint AS tok, $4::bigint AS job) p`,
			src, key, token, job).Scan(&outcome); err != nil {
			t.Errorf("%s --> %s : %s: %v", tr.from, tr.to, tr.label, err)
		} else if outcome != tr.outcome {
			t.Errorf("%s --> %s : %s: answered %q, want %q", tr.from, tr.to, tr.label, outcome, tr.outcome)
		}
		if tr.label == "release" {
			// A release ends the key's retention ReleaseGrace after it, in
			// the database and every cache at once.
			advance(t, ctx, conn, idem.ReleaseGrace+time.Second)
		}
		if err := conn.QueryRow(ctx, keyState, src, key).Scan(&got); err != nil || got != tr.to {
			t.Errorf("%s --> %s : %s: the key is %q afterwards (%v)", tr.from, tr.to, tr.label, got, err)
		}
		if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', '2026-06-15 12:00:00Z', false)`); err != nil {
			t.Fatal(err)
		}
	}
}

// mermaidStateDiagram returns the first ```mermaid block of doc that is a
// stateDiagram-v2.
func mermaidStateDiagram(doc string) (string, bool) {
	for _, part := range strings.Split(doc, "```mermaid\n")[1:] {
		block, _, _ := strings.Cut(part, "```")
		if strings.HasPrefix(strings.TrimSpace(block), "stateDiagram-v2") {
			return block, true
		}
	}
	return "", false
}
