package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
)

// TestUnstorableOutcomes: whatever a handler returns, its event completes
// or is dead-lettered, and the handler runs no more than its attempts
// (MaxAttempts 2), River finalizes its job, and Repair requeues nothing:
//   - a result holding a NUL, a lone surrogate, a number beyond numeric or
//     over 1 MiB completes the event without its result, in one run (before,
//     a NUL failed the completion query and every attempt rolled back, and
//     replays did the same);
//   - an error page cut at 4,096 bytes in the middle of a character
//     (FromHTTP), an error holding a NUL or invalid UTF-8 is dead-lettered
//     after 2 runs (before, idem.queue_fail refused the text: the failure
//     was never recorded and repair re-enqueued the event for ever; River's
//     completer refused the NUL);
//   - an idem.Permanent error whose text is not UTF-8 is dead-lettered in
//     one run.
func TestUnstorableOutcomes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	type outcome struct {
		result any
		err    error
	}
	// A localized 500 page: 4,095 bytes of text, then "é", cut by FromHTTP
	// after its first byte.
	page := strings.Repeat("x", 4095) + "é and more"
	outcomes := map[string]outcome{
		"result NUL":            {result: map[string]string{"s": "a\x00b"}},
		"result lone surrogate": {result: json.RawMessage(`{"s": "\ud800"}`)},
		"result numeric":        {result: json.RawMessage(`[1e131072]`)},
		"result over 1 MiB":     {result: map[string]string{"blob": strings.Repeat("x", 1100000)}},
		"error NUL":             {err: errors.New("bad\x00thing")},
		"error invalid UTF-8":   {err: errors.New("bad \xff\xfe thing")},
		"permanent invalid":     {err: idem.Permanent(errors.New("refused \xc3"))},
	}
	var mu sync.Mutex
	runs := map[string]int{}
	page500 := inbox.FromHTTP(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(page))
	}))
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, DefaultMaxAttempts: 2, RepairEvery: -1,
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			mu.Lock()
			runs[d.Key]++
			mu.Unlock()
			if d.Key == "error page cut mid-character" {
				return page500(ctx, tx, d)
			}
			if err := record(ctx, tx, d); err != nil {
				return nil, err
			}
			o := outcomes[d.Key]
			return o.result, o.err
		}})
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{"error page cut mid-character"}
	for k := range outcomes {
		keys = append(keys, k)
	}
	for _, k := range keys {
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "odd", Key: k, Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	start(t, in, 4, nil)
	waitFor(t, "every job finalized", func() bool {
		return count(t, pool, `SELECT count(*) FROM river_job WHERE kind = $1 AND finalized_at IS NOT NULL`, inbox.Kind) == len(keys)
	})
	if _, err := in.Repair(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // anything requeued would run now
	dead, err := in.DeadLetters(ctx, inbox.Filter{Source: "odd"})
	if err != nil {
		t.Fatal(err)
	}
	deadByKey := map[string]inbox.DeadLetter{}
	for _, d := range dead {
		deadByKey[d.Key] = d
	}
	mu.Lock()
	defer mu.Unlock()
	for _, k := range keys {
		var status, lastError string
		if err := pool.QueryRow(ctx, `SELECT status, coalesce(last_error, '') FROM idem.processed_events WHERE source = 'odd' AND key = $1`, k).Scan(&status, &lastError); err != nil {
			t.Fatal(err)
		}
		d, isDead := deadByKey[k]
		switch {
		case strings.HasPrefix(k, "result"):
			if status != "completed" || !strings.HasPrefix(lastError, "result not stored: ") || runs[k] != 1 || isDead ||
				count(t, pool, `SELECT count(*) FROM processed WHERE key = $1`, k) != 1 {
				t.Errorf("%s: %s %q, ran %d times, dead %v", k, status, lastError, runs[k], isDead)
			}
		case k == "permanent invalid":
			if !isDead || runs[k] != 1 || d.State != rivertype.JobStateCancelled {
				t.Errorf("%s: dead %v %+v, ran %d times", k, isDead, d, runs[k])
			}
		default:
			if !isDead || runs[k] != 2 || d.State != rivertype.JobStateDiscarded || d.LastError == "" {
				t.Errorf("%s: dead %v %+v, ran %d times", k, isDead, d, runs[k])
			}
		}
	}
}
