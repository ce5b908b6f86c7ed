package inbox_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestInboxMomentaryNotCounted: behind the inbox, as on the synchronous
// paths, an answer about the moment (503, 429) is never an attempt: a
// handler that answers them six times under DefaultMaxAttempts 2 runs
// again until it succeeds, and the event is processed once, not
// dead-lettered; the key's attempts stay 1. A handler that answers 500
// twice is dead-lettered, as before.
func TestInboxMomentaryNotCounted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	var calls, bad atomic.Int32
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, "broken") {
			bad.Add(1)
			http.Error(w, "a bug", http.StatusInternalServerError)
			return
		}
		switch n := calls.Add(1); {
		case n <= 3:
			http.Error(w, "the payment API is down", http.StatusServiceUnavailable)
		case n <= 6:
			w.Header().Set("Retry-After", "0")
			http.Error(w, "rate limited", http.StatusTooManyRequests)
		default:
			w.WriteHeader(http.StatusNoContent)
		}
	})
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, DefaultMaxAttempts: 2})
	if err != nil {
		t.Fatal(err)
	}
	orders, err := in.HTTP(idemhttp.Config{Client: testdb.Client(t, pool, nil), Source: "orders", Scope: idemhttp.Unscoped}, h)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(orders)
	t.Cleanup(srv.Close)
	for _, path := range []string{"/orders/1", "/broken/1"} {
		req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", path)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("%s: %d, want 202", path, resp.StatusCode)
		}
	}
	start(t, in, 2, nil)

	deadline := time.Now().Add(60 * time.Second)
	for {
		var done, dead int
		if err := pool.QueryRow(ctx, `SELECT
			(SELECT count(*) FROM idem.processed_events WHERE source = 'orders' AND key = '/orders/1' AND status = 'completed'),
			(SELECT count(*) FROM idem.holds WHERE source = 'orders' AND key = '/broken/1' AND state = 'dead')`).Scan(&done, &dead); err != nil {
			t.Fatal(err)
		}
		if done == 1 && dead == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 60 s: %d calls, the event completed %d, the broken one dead %d", calls.Load(), done, dead)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var attempts int
	if err := pool.QueryRow(ctx, `SELECT attempts FROM idem.processed_events WHERE source = 'orders' AND key = '/orders/1'`).Scan(&attempts); err != nil {
		t.Fatal(err)
	}
	if calls.Load() != 7 || attempts != 1 || bad.Load() != 2 {
		t.Fatalf("%d calls (want 7: six momentary answers, one success), the key's attempts %d (want 1), the broken handler ran %d times (want 2)",
			calls.Load(), attempts, bad.Load())
	}
	letters, err := in.DeadLetters(ctx, inbox.Filter{Source: "orders"})
	if err != nil || len(letters) != 1 || letters[0].Key != "/broken/1" {
		t.Fatalf("dead letters: %+v %v, want the broken event only", letters, err)
	}
}
