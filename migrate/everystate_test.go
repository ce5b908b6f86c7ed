package migrate_test

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
)

// The every-state fixture: an installation holding keys in every state a
// key can be in, across sources of different ttls and across months (the
// current one, earlier ones, the default partition, a month before a
// source's window), built at a given version through that version's own
// SQL protocol (claim, complete, fail, extend, the inbox's queue_*, the
// adoption's adopt_*, wait_begin), with the answer of every key recorded.
// A test upgrades the database and checks that every key answers the same
// (everyState.check). The check reads none of idem's tables: what is
// compared is what the protocol answers, so it holds whatever layout a
// migration gives idem.processed_events.

// Fixture sources and their ttls (each with a lease of 5 minutes and
// max_attempts everyMax).
var everySources = []struct {
	name string
	ttl  time.Duration
}{
	{"d7", 7 * 24 * time.Hour},
	{"d30", 30 * 24 * time.Hour},
	{"d90", 90 * 24 * time.Hour},
	{"d400", 400 * 24 * time.Hour},
}

const (
	everyAdopt   = "adopt" // the source a legacy table is being adopted into (ttl 90 days)
	everyMax     = 3       // max_attempts of every fixture source
	everyFP      = "fp-a"  // the fingerprint keys are claimed with, where they are
	everyOtherFP = "fp-b"  // the fingerprint a mismatch is probed with
	day          = 24 * time.Hour
)

// everyKey is one key of the fixture.
type everyKey struct {
	State  string // the state, as the report names it
	Source string
	Key    string
	Where  string // where its row is: "the current month", "the default partition", "the legacy table", ...
	// ProbeFP is the fingerprint its claim is probed with ("" for none).
	ProbeFP string
	// Token is the last token the key was given (-1 when it has none):
	// complete, fail and extend are probed with it, as its last worker
	// would call them.
	Token int64
	// Outcome is what the state means a claim answers: checked at the
	// fixture's version, so the fixture is what it says it is.
	Outcome string
	// Finish: the key is in flight; after the upgrade its worker completes
	// it with Token (and a waiter, if Waited, is woken).
	Finish bool
	Waited bool // a waiter is registered (idem.wait_begin) and LISTENs
	// Prunable: the key's row is expired, its lease too, and no hold
	// keeps it: idem.prune may delete it at any time. A migration that
	// leaves such rows behind answers as if prune had run: peek finds no
	// row, complete, fail and extend answer not_found (its claim must
	// answer as before all the same).
	Prunable bool
	// Expired: the key's row is expired (a claim takes the key as new)
	// but something keeps it from prune (a hold, a ttl raised since). Since
	// migration 27 idem.peek answers for a live row only, so its peek may
	// read as no row.
	Expired bool
}

func (k everyKey) id() string { return k.Source + "/" + k.Key }

// everyAnswer is a key's answer, field by field (each a JSON value as the
// database rendered it, in UTC): idem.claim's fields (its token only as set
// or not: a new token is a new number), idem.peek's, and what complete,
// fail and extend answer to the key's last token. Each probe runs in a
// transaction rolled back, at the fixture's time (the test clock), so the
// key's state is kept and every time-derived field is the same on every
// run.
type everyAnswer map[string]string

// everyState is a built fixture.
type everyState struct {
	Version int64
	At      time.Time // the time every probe runs at (idem.clock())
	Keys    []everyKey
	Want    map[string]everyAnswer // by everyKey.id(), recorded at Version
	url     string
	waiters map[string]int64 // wait_begin ids by key id
	listen  *pgx.Conn        // LISTEN idem_done since before the upgrade
}

// States lists the fixture's states, each once, in order.
func (s *everyState) States() []string {
	var out []string
	for _, k := range s.Keys {
		if !slices.Contains(out, k.State) {
			out = append(out, k.State)
		}
	}
	return out
}

// installClock (re)installs the test clock: idem.clock() honours the
// session's idem.test_now (a migrated empty database has the plain clock).
func installClock(t *testing.T, ctx context.Context, conn *pgx.Conn) {
	t.Helper()
	if _, err := conn.Exec(ctx, pgcluster.ClockOverrideSQL); err != nil {
		t.Fatalf("install the test clock: %v", err)
	}
}

// buildEveryState migrates the empty database at url to version with p,
// builds the every-state fixture in it and records every key's answer.
// The fixture's clock is now: rows are put into earlier months by running
// the protocol at earlier times (idem.clock()).
func buildEveryState(t *testing.T, ctx context.Context, url string, p *goose.Provider, version int64) *everyState {
	t.Helper()
	if _, err := p.UpTo(ctx, version); err != nil {
		t.Fatalf("migrate up to %d: %v", version, err)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	installClock(t, ctx, conn)

	at := time.Now().UTC().Truncate(time.Second)
	s := &everyState{Version: version, At: at, Want: map[string]everyAnswer{}, url: url, waiters: map[string]int64{}}
	exec := func(when time.Time, sql string, args ...any) {
		t.Helper()
		if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', $1, false)`, when.Format(time.RFC3339Nano)); err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("fixture at %s: %s: %v", when.Format(time.RFC3339), sql, err)
		}
	}
	token := func(when time.Time, sql string, args ...any) int64 {
		t.Helper()
		if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', $1, false)`, when.Format(time.RFC3339Nano)); err != nil {
			t.Fatal(err)
		}
		var tok *int64
		if err := conn.QueryRow(ctx, sql, args...).Scan(&tok); err != nil || tok == nil {
			t.Fatalf("fixture at %s: %s: token %v, %v", when.Format(time.RFC3339), sql, tok, err)
		}
		return *tok
	}

	// Sources, and every month from the oldest row's to next month, but
	// for one: the month 150 days back has no partition, its keys are in
	// the default partition.
	for _, src := range everySources {
		exec(at, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ($1, $2::interval, $3::interval, $4)`,
			src.name, fmt.Sprintf("%d days", src.ttl/day), "5 minutes", everyMax)
	}
	exec(at, `INSERT INTO idem.policies (source, ttl, lease) VALUES ($1, '90 days', '5 minutes')`, everyAdopt)
	defaultMonth := testdb.MonthStart(at.Add(-150*day), 0)
	for m := testdb.MonthStart(at.Add(-520*day), 0); !m.After(testdb.MonthStart(at, 1)); m = testdb.MonthStart(m, 1) {
		if !m.Equal(defaultMonth) {
			exec(at, `SELECT idem.create_partition($1::date)`, m)
		}
	}
	where := func(src string, age time.Duration) string {
		m := testdb.MonthStart(at.Add(-age), 0)
		switch {
		case m.Equal(defaultMonth):
			return "the default partition"
		case m.Equal(testdb.MonthStart(at, 0)):
			return "the current month"
		}
		// A claim of the source looks back its ttl and 2 days, or the
		// default policy's 30 days and 2 if longer (idem.lookbacks).
		for _, s := range everySources {
			if s.name == src && m.Before(testdb.MonthStart(at.Add(-max(s.ttl+2*day, 32*day)), 0)) {
				return m.Format("2006-01") + ", before the source's window"
			}
		}
		return m.Format("2006-01")
	}
	add := func(k everyKey) { s.Keys = append(s.Keys, k) }
	claim := func(when time.Time, src, key, fp string) int64 {
		t.Helper()
		var out string
		tok := token(when, `SELECT coalesce(token, 0) FROM idem.claim($1, $2, fingerprint => nullif($3, ''))`, src, key, fp)
		if tok == 0 {
			_ = conn.QueryRow(ctx, `SELECT to_jsonb(c)::text FROM idem.claim($1, $2, fingerprint => nullif($3, '')) c`, src, key, fp).Scan(&out)
			t.Fatalf("fixture at %s: claim %s/%s did not acquire: %s", when.Format(time.RFC3339), src, key, out)
		}
		return tok
	}

	// Keys with live rows, in each state, for every source and age (a
	// row's age picks its month).
	placements := []struct {
		src string
		age time.Duration
	}{
		{"d7", 10 * time.Minute},
		{"d30", 10 * time.Minute}, {"d30", 20 * day},
		{"d90", 45 * day}, {"d90", 80 * day},
		{"d400", 10 * time.Minute}, {"d400", 150 * day}, {"d400", 300 * day},
	}
	for _, pl := range placements {
		a := at.Add(-pl.age)
		w := where(pl.src, pl.age)
		name := func(state string) string { return state + "-" + ageName(pl.age) }
		k := everyKey{Source: pl.src, Where: w}

		k.State, k.Key, k.Outcome, k.Finish = "in flight (live lease)", name("inflight"), "in_progress", true
		k.Token = claim(a, pl.src, k.Key, "")
		exec(at.Add(-time.Minute), `SELECT idem.extend($1, $2, $3, '2 hours')`, pl.src, k.Key, k.Token)
		add(k)
		k.Finish = false

		k.State, k.Key, k.Outcome = "processing, lease expired (crashed worker)", name("crashed"), "acquired"
		k.Token = claim(a, pl.src, k.Key, "")
		add(k)

		k.State, k.Key, k.Outcome = "completed, result stored", name("completed"), "completed"
		k.Token = claim(a, pl.src, k.Key, "")
		exec(a.Add(time.Second), `SELECT idem.complete($1, $2, $3, jsonb_build_object('key', $2::text, 'n', 1))`, pl.src, k.Key, k.Token)
		add(k)

		k.State, k.Key, k.Outcome = "completed, result not stored", name("unstored"), "completed"
		k.Token = claim(a, pl.src, k.Key, "")
		exec(a.Add(time.Second), `SELECT idem.complete_unstored($1, $2, $3, 'result over 1 MiB')`, pl.src, k.Key, k.Token)
		add(k)

		k.State, k.Key, k.Outcome = "failed, retryable", name("retryable"), "acquired"
		k.Token = claim(a, pl.src, k.Key, "")
		exec(a.Add(time.Second), `SELECT idem.fail($1, $2, $3, 'timeout', true)`, pl.src, k.Key, k.Token)
		add(k)

		k.State, k.Key, k.Outcome = "failed momentarily (the attempt taken back)", name("momentary"), "acquired"
		k.Token = claim(a, pl.src, k.Key, "")
		exec(a.Add(time.Second), `SELECT idem.fail($1, $2, $3, 'rate limited', NULL)`, pl.src, k.Key, k.Token)
		add(k)

		k.State, k.Key, k.Outcome = "failed permanently", name("failed"), "failed"
		k.Token = claim(a, pl.src, k.Key, "")
		exec(a.Add(time.Second), `SELECT idem.fail($1, $2, $3, 'card declined', false)`, pl.src, k.Key, k.Token)
		add(k)

		k.State, k.Key, k.Outcome = "failed retryable max_attempts times", name("maxed"), "failed"
		for i := range everyMax {
			k.Token = claim(a.Add(time.Duration(i)*time.Minute), pl.src, k.Key, "")
			exec(a.Add(time.Duration(i)*time.Minute+time.Second), `SELECT idem.fail($1, $2, $3, $4, true)`, pl.src, k.Key, k.Token, fmt.Sprintf("attempt %d failed", i+1))
		}
		add(k)

		k.State, k.Key, k.Outcome = "lease lost at max_attempts", name("maxed-lease"), "failed"
		for i := range everyMax {
			k.Token = claim(a.Add(time.Duration(i)*time.Minute), pl.src, k.Key, "")
			if i < everyMax-1 {
				exec(a.Add(time.Duration(i)*time.Minute+time.Second), `SELECT idem.fail($1, $2, $3, 'timeout', true)`, pl.src, k.Key, k.Token)
			}
		}
		add(k)

		k.State, k.Key, k.Outcome, k.ProbeFP = "completed, probed with another fingerprint (mismatch)", name("mismatch"), "mismatch", everyOtherFP
		k.Token = claim(a, pl.src, k.Key, everyFP)
		exec(a.Add(time.Second), `SELECT idem.complete($1, $2, $3, '{"fp": "a"}')`, pl.src, k.Key, k.Token)
		add(k)

		k.State, k.Key, k.Outcome, k.Finish = "in flight, probed with another fingerprint (mismatch)", name("mismatch-inflight"), "mismatch", true
		k.Token = claim(a, pl.src, k.Key, everyFP)
		exec(at.Add(-time.Minute), `SELECT idem.extend($1, $2, $3, '2 hours')`, pl.src, k.Key, k.Token)
		add(k)
		k.ProbeFP, k.Finish = "", false

		k.State, k.Key, k.Outcome = "completed, probed with the same fingerprint", name("samefp"), "completed"
		k.ProbeFP = everyFP
		k.Token = claim(a, pl.src, k.Key, everyFP)
		exec(a.Add(time.Second), `SELECT idem.complete($1, $2, $3, '{"fp": "a"}')`, pl.src, k.Key, k.Token)
		add(k)
	}

	// Expired keys (ttl passed): answered as new. Just past the ttl, and
	// long past it (in a month before the source's window).
	for _, src := range everySources {
		for _, age := range []time.Duration{src.ttl + 3*day, src.ttl + 100*day} {
			a := at.Add(-age)
			k := everyKey{Source: src.name, Where: where(src.name, age), Outcome: "acquired", Prunable: true}
			k.State, k.Key = "expired (completed, ttl passed)", "expired-completed-"+ageName(age)
			k.Token = claim(a, src.name, k.Key, "")
			exec(a.Add(time.Second), `SELECT idem.complete($1, $2, $3, '{"old": true}')`, src.name, k.Key, k.Token)
			add(k)
			k.State, k.Key = "expired (failed permanently, ttl passed)", "expired-failed-"+ageName(age)
			k.Token = claim(a, src.name, k.Key, "")
			exec(a.Add(time.Second), `SELECT idem.fail($1, $2, $3, 'declined', false)`, src.name, k.Key, k.Token)
			add(k)
			k.State, k.Key = "expired (processing, ttl passed)", "expired-processing-"+ageName(age)
			k.Token = claim(a, src.name, k.Key, "")
			add(k)
		}
	}
	// In flight long past its source's ttl: a worker that heartbeats
	// (extend) for weeks keeps its row live, in a month the ttl alone
	// would not look back to.
	for _, h := range []struct {
		src string
		age time.Duration
	}{{"d7", 40 * day}, {"d30", 50 * day}} {
		a := at.Add(-h.age)
		k := everyKey{State: "in flight past its source's ttl (heartbeats for weeks)", Source: h.src, Key: "heartbeats-" + ageName(h.age),
			Where: where(h.src, h.age), Outcome: "in_progress", Finish: true}
		k.Token = claim(a, h.src, k.Key, "")
		for beat := a.Add(time.Minute); beat.Before(at.Add(-time.Hour)); beat = beat.Add(6 * day) {
			exec(beat, `SELECT idem.extend($1, $2, $3, '7 days')`, h.src, k.Key, k.Token)
		}
		exec(at.Add(-time.Minute), `SELECT idem.extend($1, $2, $3, '2 hours')`, h.src, k.Key, k.Token)
		add(k)
	}

	// A source whose ttl was cut (90 days to 7) and one whose ttl was
	// raised (7 days to 90) with keys stored: a stored key keeps the
	// expiry it was given.
	exec(at, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('ttl-cut', '90 days', '5 minutes'), ('ttl-raised', '7 days', '5 minutes')`)
	for _, c := range []struct {
		src, state, outcome string
		age                 time.Duration
	}{
		{"ttl-cut", "completed, its source's ttl cut since (90 to 7 days)", "completed", 45 * day},
		{"ttl-cut", "completed, its source's ttl cut since (90 to 7 days)", "completed", 3 * day},
		{"ttl-raised", "expired, its source's ttl raised since (7 to 90 days)", "acquired", 10 * day},
		{"ttl-raised", "completed, its source's ttl raised since (7 to 90 days)", "completed", 3 * day},
	} {
		a := at.Add(-c.age)
		k := everyKey{State: c.state, Source: c.src, Key: c.src + "-" + ageName(c.age), Where: where(c.src, c.age), Outcome: c.outcome, Expired: c.outcome == "acquired"}
		k.Token = claim(a, c.src, k.Key, "")
		exec(a.Add(time.Second), `SELECT idem.complete($1, $2, $3, '{"ttl": "as stored"}')`, c.src, k.Key, k.Token)
		add(k)
	}
	exec(at.Add(-time.Hour), `UPDATE idem.policies SET ttl = '7 days' WHERE source = 'ttl-cut'`)
	exec(at.Add(-time.Hour), `UPDATE idem.policies SET ttl = '90 days' WHERE source = 'ttl-raised'`)

	// A key never seen.
	add(everyKey{State: "never seen", Source: "d30", Key: "never-seen", Where: "nowhere", Token: -1, Outcome: "acquired"})

	// Held by the inbox (idem.holds), as inbox's jobs hold them: accepted
	// (queue_hold in the claim's transaction), taken by the job
	// (queue_take), dead (queue_fail with dead).
	type held struct {
		state, src, key, outcome string
		age                      time.Duration
		take                     string // "", "live" (taken with a lease that lasts), "crashed", "dead"
	}
	var job int64 = 1000
	for _, h := range []held{
		{"held: accepted, its job not started", "d30", "held-queued", "in_progress", 10 * time.Minute, ""},
		{"held: taken by its job (live lease)", "d90", "held-taken", "in_progress", 45 * day, "live"},
		{"held: its job crashed, its row expired in a month before the window", "d7", "held-before-window", "in_progress", 100 * day, "crashed"},
		{"held: taken by its job (live lease)", "d400", "held-taken-default", "in_progress", 150 * day, "live"},
		{"held: dead (dead letter)", "d30", "held-dead", "acquired", 20 * day, "dead"},
		{"held: dead (dead letter)", "d400", "held-dead-default", "acquired", 150 * day, "dead"},
	} {
		job++
		a := at.Add(-h.age)
		k := everyKey{State: h.state, Source: h.src, Key: h.key, Where: where(h.src, h.age), Outcome: h.outcome, Expired: h.key == "held-before-window"}
		jt := claim(a, h.src, h.key, "")
		exec(a, `SELECT idem.queue_hold($1, $2, $3, $4)`, h.src, h.key, jt, job)
		k.Token = jt
		switch h.take {
		case "live":
			k.Token = token(at.Add(-time.Minute), `SELECT token FROM idem.queue_take($1, $2, $3, $4, '2 hours')`, h.src, h.key, jt, job)
		case "crashed", "dead":
			k.Token = token(a.Add(time.Minute), `SELECT token FROM idem.queue_take($1, $2, $3, $4, '5 minutes')`, h.src, h.key, jt, job)
		}
		if h.take == "dead" {
			exec(a.Add(2*time.Minute), `SELECT idem.queue_fail($1, $2, $3, $4, 'poison message', true)`, h.src, h.key, jt, k.Token)
		}
		add(k)
	}

	// An adoption in progress (idemctl adopt): a legacy table, one key of
	// it copied, the others answered from it by the claim.
	exec(at, `CREATE TABLE public.legacy_events (event_id text PRIMARY KEY, processed_at timestamptz NOT NULL, response jsonb)`)
	for _, l := range []struct {
		key string
		age time.Duration
		res string
	}{
		{"adopt-0-copied", 30 * day, `{"legacy": "copied"}`},
		{"adopt-1-recent", 5 * day, `{"legacy": "recent"}`},
		{"adopt-2-old-month", 60 * day, `{"legacy": "old"}`},
		{"adopt-3-expired", 200 * day, `{"legacy": "expired"}`},
		{"adopt-4-no-result", 8 * day, ``},
		{"adopt-5-in-flight-in-idem", 5 * day, `{"legacy": "in idem too"}`},
	} {
		exec(at, `INSERT INTO public.legacy_events VALUES ($1, $2, nullif($3, '')::jsonb)`, l.key, at.Add(-l.age), l.res)
	}
	// Claimed in idem before the adoption began, and in flight.
	inIdem := everyKey{State: "adopted: in the legacy table and in flight in idem", Source: everyAdopt, Key: "adopt-5-in-flight-in-idem", Where: "the current month", Outcome: "in_progress", Finish: true}
	inIdem.Token = claim(at.Add(-10*time.Minute), everyAdopt, inIdem.Key, "")
	exec(at.Add(-time.Minute), `SELECT idem.extend($1, $2, $3, '2 hours')`, everyAdopt, inIdem.Key, inIdem.Token)
	var adoption int64
	if err := conn.QueryRow(ctx, `SELECT idem.adopt_start($1, 'public.legacy_events'::regclass, 'event_id', 'processed_at', 'response')`, everyAdopt).Scan(&adoption); err != nil {
		t.Fatalf("adopt_start: %v", err)
	}
	exec(at, `SELECT idem.adopt_batch($1, 1)`, adoption)
	for _, k := range []everyKey{
		{State: "adopted: copied from the legacy table", Key: "adopt-0-copied", Where: "copied", Outcome: "completed"},
		{State: "adopted: in the legacy table only", Key: "adopt-1-recent", Where: "the legacy table", Outcome: "completed"},
		{State: "adopted: in the legacy table only", Key: "adopt-2-old-month", Where: "the legacy table, two months back", Outcome: "completed"},
		{State: "adopted: in the legacy table only, no result", Key: "adopt-4-no-result", Where: "the legacy table", Outcome: "completed"},
		{State: "adopted: in the legacy table, past its ttl", Key: "adopt-3-expired", Where: "the legacy table", Outcome: "acquired"},
		{State: "adopted: not in the legacy table", Key: "adopt-9-absent", Where: "nowhere", Outcome: "acquired"},
	} {
		k.Source, k.Token = everyAdopt, -1
		add(k)
	}
	{
		add(inIdem)
		k := everyKey{State: "adopted source: completed in idem", Source: everyAdopt, Key: "adopt-6-native", Where: "the current month", Outcome: "completed"}
		k.Token = claim(at.Add(-10*time.Minute), everyAdopt, k.Key, "")
		exec(at.Add(-9*time.Minute), `SELECT idem.complete($1, $2, $3, '{"native": true}')`, everyAdopt, k.Key, k.Token)
		add(k)
	}

	// Waited on: in flight, a waiter registered (idem.wait_begin, as a
	// client's WithWait does) and listening (LISTEN idem_done) from before
	// the upgrade to the completion after it.
	for _, w := range []struct {
		src string
		age time.Duration
	}{{"d90", 10 * time.Minute}, {"d400", 150 * day}, {"d30", 20 * day}} {
		a := at.Add(-w.age)
		k := everyKey{State: "waited on (in flight, a waiter registered)", Source: w.src, Key: "waited-" + ageName(w.age),
			Where: where(w.src, w.age), Outcome: "in_progress", Finish: true, Waited: true}
		k.Token = claim(a, w.src, k.Key, "")
		exec(at.Add(-time.Minute), `SELECT idem.extend($1, $2, $3, '2 hours')`, w.src, k.Key, k.Token)
		var id int64
		if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', $1, false)`, at.Format(time.RFC3339Nano)); err != nil {
			t.Fatal(err)
		}
		if err := conn.QueryRow(ctx, `SELECT idem.wait_begin($1, $2, '1 hour')`, w.src, k.Key).Scan(&id); err != nil {
			t.Fatalf("wait_begin: %v", err)
		}
		s.waiters[k.id()] = id
		add(k)
	}
	s.listen, err = pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.listen.Close(context.Background()) })
	if _, err := s.listen.Exec(ctx, `LISTEN idem_done`); err != nil {
		t.Fatal(err)
	}

	// Every key's answer at this version, and the fixture is what it says.
	for _, k := range s.Keys {
		if _, dup := s.Want[k.id()]; dup {
			t.Fatalf("fixture: key %s twice", k.id())
		}
		ans := s.probe(t, ctx, conn, k)
		if got := ans["claim.outcome"]; got != `"`+k.Outcome+`"` {
			t.Errorf("version %d: fixture key %s (%s, %s) answers %s, want %q: %v", version, k.id(), k.State, k.Where, got, k.Outcome, ans)
		}
		s.Want[k.id()] = ans
	}
	if t.Failed() {
		t.FailNow()
	}
	return s
}

// everyProbes are the calls a key is probed with, each in a transaction
// rolled back at the fixture's time: its claim (with the probe's
// fingerprint), its claim in a batch (the key, then a key never seen: the
// batch's answer for the key, compared as the claim's), its peek, and
// complete, fail and extend with the key's last token, as its last worker
// would call them.
var everyProbes = []struct {
	name, sql string
	args      func(k everyKey) []any
}{
	{"claim", `SELECT to_jsonb(c) FROM idem.claim($1, $2, fingerprint => nullif($3, '')) c`,
		func(k everyKey) []any { return []any{k.Source, k.Key, k.ProbeFP} }},
	{"batch", `SELECT to_jsonb(c) FROM idem.claim_batch($1, ARRAY[$2, 'every-batch-probe'], ARRAY[nullif($3, ''), NULL]) c WHERE c.ord = 1`,
		func(k everyKey) []any { return []any{k.Source, k.Key, k.ProbeFP} }},
	{"peek", `SELECT to_jsonb(p) FROM idem.peek($1, $2) p`,
		func(k everyKey) []any { return []any{k.Source, k.Key} }},
	{"complete", `SELECT to_jsonb(idem.complete($1, $2, $3, '{"probe": true}'))`,
		func(k everyKey) []any { return []any{k.Source, k.Key, k.Token} }},
	{"fail", `SELECT to_jsonb(idem.fail($1, $2, $3, 'probe', true))`,
		func(k everyKey) []any { return []any{k.Source, k.Key, k.Token} }},
	{"extend", `SELECT to_jsonb(x) FROM idem.extend($1, $2, $3, '1 hour') x`,
		func(k everyKey) []any { return []any{k.Source, k.Key, k.Token} }},
}

// everyClaimFields are the fields of idem.claim's answer compared (version
// 23's; a later claim may answer more).
var everyClaimFields = []string{"outcome", "token", "attempt", "lease_expires_at", "result", "error", "first_seen", "expires_at", "lease_remaining"}

// probe answers key k at the fixture's time, every probe rolled back.
func (s *everyState) probe(t *testing.T, ctx context.Context, conn *pgx.Conn, k everyKey) everyAnswer {
	t.Helper()
	ans := everyAnswer{}
	for _, p := range everyProbes {
		tx, err := conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var raw []byte
		if _, err = tx.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', $1, true), set_config('TimeZone', 'UTC', true), set_config('IntervalStyle', 'iso_8601', true)`,
			s.At.Format(time.RFC3339Nano)); err == nil {
			err = tx.QueryRow(ctx, p.sql, p.args(k)...).Scan(&raw)
		}
		_ = tx.Rollback(ctx)
		if err != nil {
			ans[p.name+".error"] = err.Error()
			continue
		}
		var fields map[string]json.RawMessage
		if json.Unmarshal(raw, &fields) != nil { // a scalar: the function's answer
			ans[p.name] = string(raw)
			continue
		}
		for f, v := range fields {
			claim := p.name == "claim" || p.name == "batch"
			if claim && !slices.Contains(everyClaimFields, f) {
				continue
			}
			if claim && f == "token" {
				v = json.RawMessage(fmt.Sprint(string(v) != "null")) // a new token is a new number
			}
			ans[p.name+"."+f] = string(v)
		}
	}
	return ans
}

// answersNow probes every key of the fixture on the database as it is now.
func (s *everyState) answersNow(t *testing.T, ctx context.Context) map[string]everyAnswer {
	t.Helper()
	conn, err := pgx.Connect(ctx, s.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	installClock(t, ctx, conn) // in case a migration replaced idem.clock()
	got := map[string]everyAnswer{}
	for _, k := range s.Keys {
		got[k.id()] = s.probe(t, ctx, conn, k)
	}
	return got
}

// pruned is what a probe answers for a key whose row is gone.
var pruned = map[string]string{
	"peek.status": "null", "peek.lease_remaining_ms": "null",
	"complete": `"not_found"`, "fail": `"not_found"`,
	"extend.outcome": `"not_found"`, "extend.lease_expires_at": "null",
}

// diff reports, by key and state, every field whose answer differs from
// the one recorded at the fixture's version (diffs), and the differences
// of a Prunable key that are what prune would have made of it (notes).
func (s *everyState) diff(got map[string]everyAnswer) (diffs, notes []string) {
	for _, k := range s.Keys {
		want, have := s.Want[k.id()], got[k.id()]
		fields := map[string]bool{}
		for f := range want {
			fields[f] = true
		}
		for f := range have {
			if (strings.HasPrefix(f, "claim.") || strings.HasPrefix(f, "batch.")) && !fields[f] {
				continue // a field a later claim added
			}
			fields[f] = true
		}
		var names []string
		for f := range fields {
			names = append(names, f)
		}
		sort.Strings(names)
		for _, f := range names {
			w, wok := want[f]
			h, hok := have[f]
			if w == h && wok == hok {
				continue
			}
			if !wok {
				w = "(none)"
			}
			if !hok {
				h = "(none)"
			}
			line := fmt.Sprintf("%s [%s; %s]: %s: %s at version %d, %s now", k.id(), k.State, k.Where, f, w, s.Version, h)
			if p, ok := pruned[f]; ok && h == p && (k.Prunable || (k.Expired && strings.HasPrefix(f, "peek."))) {
				notes = append(notes, line)
				continue
			}
			diffs = append(diffs, line)
		}
	}
	return diffs, notes
}

// check probes every key and fails t with every difference from the
// answers recorded at the fixture's version.
func (s *everyState) check(t *testing.T, ctx context.Context, stage string) {
	t.Helper()
	d, notes := s.diff(s.answersNow(t, ctx))
	if len(d) > 0 {
		t.Errorf("%s: %d answers differ from version %d's:\n%s", stage, len(d), s.Version, strings.Join(d, "\n"))
	}
	if len(notes) > 0 {
		t.Logf("%s: %d answers of expired keys are a pruned row's (as idem.prune may make them):\n%s", stage, len(notes), strings.Join(notes, "\n"))
	}
}

// finish completes every in-flight key with the token its worker got
// before the upgrade (each must answer "completed", and afterwards its
// claim "completed" with that result), and checks that every waiter
// registered before the upgrade is woken (a notification on idem_done
// with the key's payload, on the connection that has listened since).
func (s *everyState) finish(t *testing.T, ctx context.Context) {
	t.Helper()
	conn, err := pgx.Connect(ctx, s.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	installClock(t, ctx, conn)
	if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', $1, false)`, s.At.Format(time.RFC3339Nano)); err != nil {
		t.Fatal(err)
	}
	for _, k := range s.Keys {
		if !k.Finish {
			continue
		}
		var out string
		if err := conn.QueryRow(ctx, `SELECT idem.complete($1, $2, $3, jsonb_build_object('finished', $2::text))`, k.Source, k.Key, k.Token).Scan(&out); err != nil || out != "completed" {
			t.Errorf("%s [%s; %s]: completing with the token it had before the upgrade: %q %v", k.id(), k.State, k.Where, out, err)
			continue
		}
		var outcome, result string
		if err := conn.QueryRow(ctx, `SELECT outcome, coalesce(result::text, '') FROM idem.claim($1, $2)`, k.Source, k.Key).Scan(&outcome, &result); err != nil ||
			outcome != "completed" || result != fmt.Sprintf(`{"finished": %q}`, k.Key) {
			t.Errorf("%s [%s]: after its completion: %s %s %v, want completed with its result", k.id(), k.State, outcome, result, err)
		}
	}
	s.woken(t, ctx)
	for id, w := range s.waiters {
		if _, err := conn.Exec(ctx, `SELECT idem.wait_end($1)`, w); err != nil {
			t.Errorf("%s: wait_end(%d) after the upgrade: %v", id, w, err)
		}
	}
}

// woken checks that every waiter of the fixture (registered, and LISTENing
// on idem_done, since before the upgrade) has been notified of its key's
// completion, waiting for the notifications at most 30 seconds.
func (s *everyState) woken(t *testing.T, ctx context.Context) {
	t.Helper()
	if left := s.notWoken(ctx, 30*time.Second); len(left) > 0 {
		t.Errorf("waiters registered before the upgrade not woken by the completion after it: %s", strings.Join(left, ", "))
	}
}

// notWoken returns the keys of the fixture's waiters that no notification
// on idem_done has woken within wait.
func (s *everyState) notWoken(ctx context.Context, wait time.Duration) []string {
	wake := map[string]string{} // payload -> key id
	for _, k := range s.Keys {
		if k.Waited {
			wake[waitPayload(k.Source, k.Key)] = k.id()
		}
	}
	wctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	for len(wake) > 0 {
		n, err := s.listen.WaitForNotification(wctx)
		if err != nil {
			break
		}
		if n.Channel == "idem_done" {
			delete(wake, n.Payload)
		}
	}
	var left []string
	for _, id := range wake {
		left = append(left, id)
	}
	sort.Strings(left)
	return left
}

// ageName names an age in a key: "10m", "150d".
func ageName(d time.Duration) string {
	if d%day == 0 {
		return fmt.Sprintf("%dd", d/day)
	}
	return fmt.Sprintf("%dm", d/time.Minute)
}

// waitPayload is idem.wait_channel_key(source, key), as version 8 defined
// it and clients listen for it.
func waitPayload(source, key string) string {
	sum := md5.Sum([]byte(source + "\x1f" + key))
	return hex.EncodeToString(sum[:])
}
