package idem_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/testdb"
)

// answerRow is one answer of idem.claim or idem.claim_batch, as text, with
// the token reduced to whether there is one (each acquisition has its own).
type answerRow struct {
	outcome, attempt, leaseAt, result, err, firstSeen, expiresAt, left string
	token                                                              bool
}

const answerCols = `outcome, token IS NOT NULL, coalesce(attempt::text, '-'), coalesce(lease_expires_at::text, '-'),
	coalesce(result::text, '-'), coalesce(error, '-'), coalesce(first_seen::text, '-'), coalesce(expires_at::text, '-'),
	coalesce(lease_remaining::text, '-')`

func scanAnswer(row pgx.Row) (answerRow, error) {
	var a answerRow
	err := row.Scan(&a.outcome, &a.token, &a.attempt, &a.leaseAt, &a.result, &a.err, &a.firstSeen, &a.expiresAt, &a.left)
	return a, err
}

// counters are what a claim writes besides its answer: the duplicate and
// activity counters and the per-key duplicate counts.
const countersSQL = `SELECT (SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts)::text || '/' ||
	(SELECT coalesce(sum(acquired), 0) || ':' || coalesce(sum(duplicates), 0) FROM idem.activity) || '/' ||
	(SELECT coalesce(string_agg(key || '=' || duplicates, ',' ORDER BY key), '') FROM idem.processed_events WHERE duplicates > 0)`

// TestClaimBatchMatchesClaim: for every state a key can be in, each item of
// a batch gets the answer idem.claim gives it, field for field, and the
// batch writes what the single claims write (rows, counters), at READ
// COMMITTED and SERIALIZABLE. The keys were first seen in the previous
// month, an hour before the boundary, and are claimed half an hour after
// it (the per-key window across months): completed, in flight, a lost
// lease (taken over, attempt 2), a retryable failure (taken over), a
// permanent failure, a fingerprint mismatch and match, held by the inbox,
// expired in the previous month and in the current one (its row replaced),
// new keys, keys repeated in the batch (duplicates of their first), a
// source with max_attempts 1 (a lost lease gives up: failed), and a source
// whose legacy table is being adopted (adopted: completed; not there:
// acquired); and the same keys as a redelivery, its first key completed
// (answered before any lock). Each side runs in a transaction that is
// rolled back, on the same data, with the clock pinned, in a session with
// DateStyle 'SQL, DMY' and TimeZone Pacific/Chatham.
func TestClaimBatchMatchesClaim(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	// A session far from ISO and UTC: the window, the months and the clock
	// arithmetic must not depend on it.
	if _, err := conn.Exec(ctx, `SET DateStyle = 'SQL, DMY'; SET TimeZone = 'Pacific/Chatham'`); err != nil {
		t.Fatal(err)
	}
	boundary := testdb.MonthStart(time.Now(), 0)
	seedAt, evalAt := boundary.Add(-time.Hour), boundary.Add(30*time.Minute)
	at := func(ts time.Time) {
		t.Helper()
		if _, err := conn.Exec(ctx, `SELECT set_config('`+testdb.ClockParam+`', $1, false)`, ts.Format(time.RFC3339Nano)); err != nil {
			t.Fatal(err)
		}
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`SELECT idem.create_partition($1)`, boundary.AddDate(0, -1, 0))
	exec(`INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling, count_per_key) VALUES ('s', '30 days', '2 minutes', 1, true);
		INSERT INTO idem.policies (source, ttl, lease, max_attempts, duplicate_sampling) VALUES ('max1', '30 days', '1 minute', 1, 1);
		INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('ad', '30 days', '1 minute', 1);
		CREATE TABLE public.legacy (k text PRIMARY KEY, at timestamptz NOT NULL)`)
	exec(`INSERT INTO public.legacy VALUES ('leg1', $1)`, seedAt.Add(-24*time.Hour))
	exec(`SELECT idem.adopt_start('ad', 'public.legacy', 'k', 'at')`)

	at(seedAt)
	claim := func(source, key, more string) int64 {
		t.Helper()
		var tok int64
		if err := conn.QueryRow(ctx, `SELECT token FROM idem.claim('`+source+`', '`+key+`'`+more+`)`).Scan(&tok); err != nil || tok == 0 {
			t.Fatalf("seed %s/%s: %v", source, key, err)
		}
		return tok
	}
	exec(`SELECT idem.complete('s', 'completed', $1, '{"r": 1}')`, claim("s", "completed", ""))
	claim("s", "inflight", ", lease => '2 hours'")
	claim("s", "lapsed", ", lease => '1 second'")
	exec(`SELECT idem.fail('s', 'retry', $1, 'try again', true)`, claim("s", "retry", ""))
	exec(`SELECT idem.fail('s', 'perm', $1, 'never', false)`, claim("s", "perm", ""))
	exec(`SELECT idem.complete('s', 'fp', $1, '"fp"')`, claim("s", "fp", ", fingerprint => 'A'"))
	exec(`SELECT idem.queue_hold('s', 'held', $1, 1)`, claim("s", "held", ", lease => '1 second'"))
	exec(`SELECT idem.complete('s', 'expprev', $1, NULL)`, claim("s", "expprev", ", ttl => '1 minute', lease => '30 seconds'"))
	claim("max1", "lapsed1", ", lease => '1 second'")
	at(evalAt.Add(-10 * time.Minute))
	exec(`SELECT idem.complete('s', 'expcur', $1, '1')`, claim("s", "expcur", ", ttl => '1 minute', lease => '30 seconds'"))
	at(evalAt)

	batches := []struct {
		source string
		keys   []string
		fps    []string // "" for NULL
	}{
		{"s", []string{"new1", "completed", "inflight", "lapsed", "retry", "perm", "fp", "fp", "held", "expprev", "expcur", "new1", "new2", "completed", "lapsed", "fp"},
			[]string{"", "", "", "", "", "", "B", "A", "", "", "", "x", "", "", "", ""}},
		// A redelivery: the first key's answer is final, so the batch reads
		// its keys before any lock (the final answers then take none).
		{"s", []string{"completed", "new3", "inflight", "lapsed", "retry", "perm", "fp", "fp", "held", "expprev", "expcur", "new3", "completed", "fp"},
			[]string{"", "", "", "", "", "", "B", "A", "", "", "", "", "", "A"}},
		{"s", []string{"perm", "fp", "inflight", "perm"}, []string{"", "B", "", ""}},
		{"max1", []string{"lapsed1", "n"}, nil},
		{"ad", []string{"leg1", "notleg", "leg1"}, nil},
		// Keys that differ only by normalization, case or a blank at an
		// end (distinct keys: the database's collation is deterministic),
		// control characters but NUL, and a key three times with
		// fingerprints NULL, set and NULL.
		{"s", []string{"new\u00e9", "newe\u0301", "NEWE\u0301", "\u00df", "ss", "A", "a", "\x01ctl", "tab\tin", "nl\nin",
			"del\x7f", " lead", "trail ", "trail", "completed", "new\u00e9", "newe\u0301", "three", "three", "three", "fp"},
			[]string{"", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "x", "", "", "t", "", "A"}},
		bulkBatch(),
	}
	for _, iso := range []string{"READ COMMITTED", "SERIALIZABLE"} {
		for _, b := range batches {
			if len(b.fps) == 0 {
				b.fps = nil
			}
			fps := make([]*string, len(b.keys))
			for i := range b.fps {
				if b.fps[i] != "" {
					fps[i] = &b.fps[i]
				}
			}
			run := func(batch bool) (answers []answerRow, counters string, rows string) {
				t.Helper()
				tx, err := conn.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.TxIsoLevel(strings.ToLower(iso))})
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				if batch {
					rs, err := tx.Query(ctx, `SELECT `+answerCols+` FROM idem.claim_batch($1, $2, $3) ORDER BY ord`, b.source, b.keys, fps)
					if err != nil {
						t.Fatal(err)
					}
					for rs.Next() {
						a, err := scanAnswer(rs)
						if err != nil {
							t.Fatal(err)
						}
						answers = append(answers, a)
					}
					if rs.Err() != nil {
						t.Fatalf("%s batch: %v", iso, rs.Err())
					}
				} else {
					for i, k := range b.keys {
						a, err := scanAnswer(tx.QueryRow(ctx, `SELECT `+answerCols+` FROM idem.claim($1, $2, $3)`, b.source, k, fps[i]))
						if err != nil {
							t.Fatalf("%s claim %s: %v", iso, k, err)
						}
						answers = append(answers, a)
					}
				}
				if err := tx.QueryRow(ctx, countersSQL).Scan(&counters); err != nil {
					t.Fatal(err)
				}
				if err := tx.QueryRow(ctx, `SELECT string_agg(format('%s/%s %s %s a%s %s %s', source, key, first_seen_month, status,
					attempts, coalesce(fingerprint, '-'), coalesce(last_error, '-')), '; ' ORDER BY source, key, first_seen_month)
					FROM idem.processed_events`).Scan(&rows); err != nil {
					t.Fatal(err)
				}
				return answers, counters, rows
			}
			single, sc, sr := run(false)
			batch, bc, br := run(true)
			if len(batch) != len(single) {
				t.Fatalf("%s %s: %d batch answers for %d keys", iso, b.source, len(batch), len(single))
			}
			for i := range single {
				if batch[i] != single[i] {
					t.Errorf("%s %s item %d (%s):\n batch  %+v\n single %+v", iso, b.source, i, b.keys[i], batch[i], single[i])
				}
			}
			if bc != sc {
				t.Errorf("%s %s: counters after the batch %s, after the single claims %s", iso, b.source, bc, sc)
			}
			if br != sr {
				t.Errorf("%s %s: rows after the batch:\n%s\nafter the single claims:\n%s", iso, b.source, br, sr)
			}
			if testing.Verbose() {
				var got []string
				for i, a := range batch {
					got = append(got, fmt.Sprintf("%s=%s", b.keys[i], a.outcome))
				}
				t.Logf("%s %s: %s", iso, b.source, strings.Join(got, " "))
			}
		}
	}
}

// bulkBatch is a batch of 1,000 keys (the most idem.claim_batch takes):
// new keys, every tenth fingerprinted, every hundredth a repeat of the one
// before, and the oracle's completed, in-flight and mismatched keys.
func bulkBatch() (b struct {
	source string
	keys   []string
	fps    []string
}) {
	b.source = "s"
	for i := range 1000 {
		k, fp := fmt.Sprintf("bulk%04d", i), ""
		switch {
		case i == 500:
			k = "completed"
		case i == 501:
			k = "inflight"
		case i == 502:
			k, fp = "fp", "B"
		case i%100 == 99:
			k = fmt.Sprintf("bulk%04d", i-1)
		case i%10 == 0:
			fp = "f"
		}
		b.keys, b.fps = append(b.keys, k), append(b.fps, fp)
	}
	return b
}

// TestClaimBatchBadInput: input idem.claim_batch cannot answer (an empty,
// NULL, two-dimensional or not 1-based keys array, 1,001 keys, a NULL key,
// fingerprints or event types of another length, an item idem.claim
// refuses) is refused with its own SQLSTATE, before anything is written;
// an item idem.claim refuses is refused with idem.claim's SQLSTATE, and
// the message names the item. 1,000 keys are taken.
func TestClaimBatchBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 2)
	thousand := make([]string, 1000)
	for i := range thousand {
		thousand[i] = fmt.Sprintf("k%04d", i)
	}
	long := strings.Repeat("k", 513)
	for _, c := range []struct {
		name, sql string
		args      []any
		code      string
		item      int   // the item the message names (0: none)
		single    []any // idem.claim's arguments for that item (nil: not an item's)
	}{
		{"empty", `SELECT * FROM idem.claim_batch('s', '{}')`, nil, "22023", 0, nil},
		{"NULL keys", `SELECT * FROM idem.claim_batch('s', NULL)`, nil, "22004", 0, nil},
		{"1001 keys", `SELECT * FROM idem.claim_batch('s', $1)`, []any{append(thousand, "k1000")}, "ID009", 0, nil},
		{"two dimensions", `SELECT * FROM idem.claim_batch('s', '{{a,b},{c,d}}')`, nil, "22023", 0, nil},
		{"from 0", `SELECT * FROM idem.claim_batch('s', '[0:1]={a,b}')`, nil, "22023", 0, nil},
		{"NULL key", `SELECT * FROM idem.claim_batch('s', ARRAY['a', NULL, 'c'])`, nil, "22004", 2, []any{"s", nil, nil}},
		{"blank key", `SELECT * FROM idem.claim_batch('s', ARRAY['a', E' \t'])`, nil, "22023", 2, []any{"s", " \t", nil}},
		{"long key", `SELECT * FROM idem.claim_batch('s', ARRAY['a', $1])`, []any{long}, "22001", 2, []any{"s", long, nil}},
		{"long fingerprint", `SELECT * FROM idem.claim_batch('s', ARRAY['a', 'b'], ARRAY[NULL, $1])`, []any{strings.Repeat("f", 513)}, "22001", 2, []any{"s", "b", strings.Repeat("f", 513)}},
		{"fingerprints short", `SELECT * FROM idem.claim_batch('s', ARRAY['a', 'b'], ARRAY['f'])`, nil, "22023", 0, nil},
		{"fingerprints long", `SELECT * FROM idem.claim_batch('s', ARRAY['a'], ARRAY['f', NULL])`, nil, "22023", 0, nil},
		{"event types short", `SELECT * FROM idem.claim_batch('s', ARRAY['a', 'b'], event_types => ARRAY['t'])`, nil, "22023", 0, nil},
		{"control source", `SELECT * FROM idem.claim_batch(E's\x01', ARRAY['a'])`, nil, "22023", 0, []any{"s\x01", "a", nil}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := pool.Exec(ctx, c.sql, c.args...)
			var pg *pgconn.PgError
			if !errors.As(err, &pg) || pg.Code != c.code {
				t.Fatalf("%v, want SQLSTATE %s", err, c.code)
			}
			if c.item > 0 && !strings.Contains(pg.Message, fmt.Sprintf("(item %d)", c.item)) {
				t.Errorf("%q does not name item %d", pg.Message, c.item)
			}
			if c.single != nil {
				_, err := pool.Exec(ctx, `SELECT * FROM idem.claim($1, $2, $3)`, c.single...)
				var one *pgconn.PgError
				if !errors.As(err, &one) || one.Code != pg.Code {
					t.Errorf("idem.claim of the item: %v, the batch: %s", err, pg.Code)
				}
			}
		})
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events`).Scan(&n); err != nil || n != 0 {
		t.Fatalf("refused batches wrote %d rows (%v)", n, err)
	}
	rows, err := pool.Query(ctx, `SELECT outcome FROM idem.claim_batch('s', $1)`, thousand)
	if err != nil {
		t.Fatal(err)
	}
	outs, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(outs) != 1000 {
		t.Fatalf("1,000 keys: %d answers, %v", len(outs), err)
	}
	for i, o := range outs {
		if o != "acquired" {
			t.Fatalf("1,000 keys: item %d %s", i+1, o)
		}
	}
}
