package idem_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

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
	}
	for _, iso := range []string{"READ COMMITTED", "SERIALIZABLE"} {
		for _, b := range batches {
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
