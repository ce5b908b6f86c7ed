package idemhttp_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// TestWaitForOriginal: 50 concurrent copies of a slow request (1 s of
// work) with Config.Wait on, over real HTTP: the handler runs once, the 49
// duplicates get the original's answer (replayed), none gets 409. Directly
// on PostgreSQL the waiters are notified (LISTEN/NOTIFY); through PgBouncer
// in transaction mode the client finds its own notification does not
// arrive and the waiters poll, with the same answers. With a wait shorter
// than the work, the duplicates get 409 after the wait, long before the
// work ends.
func TestWaitForOriginal(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		bouncer  bool
		wait     time.Duration
		wantWait bool // the duplicates get the original's answer
	}{
		{"notified", false, 10 * time.Second, true},
		{"polling behind PgBouncer", true, 10 * time.Second, true},
		{"wait shorter than the work", false, 300 * time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			url := testdb.New(t)
			if tc.bouncer {
				var db string
				if err := testdb.Pool(t, url, 1).QueryRow(context.Background(), `SELECT current_database()`).Scan(&db); err != nil {
					t.Fatal(err)
				}
				url = testdb.PgBouncer(t, db)
			}
			pool := testdb.Pool(t, url, 16)
			var logs testdb.Buffer
			c, err := idem.New(pool, &idem.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int64
			var finished atomic.Int64 // unix nanos when the work ended
			h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				time.Sleep(time.Second)
				finished.Store(time.Now().UnixNano())
				fmt.Fprintf(w, "run %d\n", n)
			})
			mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "api", Wait: tc.wait, Scope: idemhttp.Unscoped})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(h))
			t.Cleanup(srv.Close)

			type answer struct {
				status   int
				replayed bool
				body     string
				at       time.Time
			}
			answers := make([]answer, 50)
			start := time.Now()
			var wg sync.WaitGroup
			for i := range answers {
				wg.Go(func() {
					req, _ := http.NewRequest("POST", srv.URL, strings.NewReader(`{"amount":4200}`))
					req.Header.Set("Idempotency-Key", "order-1")
					req.Close = true
					resp, err := client.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					b, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					answers[i] = answer{resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader) == "true", string(b), time.Now()}
				})
			}
			wg.Wait()
			if runs.Load() != 1 {
				t.Fatalf("the handler ran %d times", runs.Load())
			}
			end := time.Unix(0, finished.Load())
			var ran, replayed, conflicts int
			var lags []time.Duration
			for _, a := range answers {
				switch {
				case a.status == 200 && !a.replayed:
					ran++
				case a.status == 200 && a.replayed && a.body == "run 1\n":
					replayed++
					lags = append(lags, a.at.Sub(end))
				case a.status == 409:
					conflicts++
					if d := a.at.Sub(start); d < tc.wait || !a.at.Before(time.Unix(0, finished.Load())) {
						t.Errorf("a 409 after %v, want after the %v wait and before the work ended", d, tc.wait)
					}
				default:
					t.Errorf("answer %+v", a)
				}
			}
			if tc.wantWait && (ran != 1 || replayed != 49 || conflicts != 0) {
				t.Fatalf("ran %d, replayed %d, 409 %d: want 1, 49, 0", ran, replayed, conflicts)
			}
			if !tc.wantWait && (ran != 1 || conflicts != 49) {
				t.Fatalf("ran %d, replayed %d, 409 %d: want 1, 0, 49", ran, replayed, conflicts)
			}
			if len(lags) > 0 {
				slices.Sort(lags)
				t.Logf("%s: the duplicates' answers after the original's work ended: p50 %v, p99 %v, max %v",
					tc.name, lags[len(lags)/2], lags[len(lags)*99/100], lags[len(lags)-1])
			}
			// Behind PgBouncer the self-test gives up after 5 s (meanwhile
			// the waiters already poll): wait for its verdict.
			polled := false
			for deadline := time.Now().Add(10 * time.Second); tc.bouncer && !polled && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
				polled = strings.Contains(logs.String(), "waiting duplicates poll instead of listening")
			}
			polled = strings.Contains(logs.String(), "waiting duplicates poll instead of listening")
			if polled != tc.bouncer {
				t.Errorf("polled %v (behind PgBouncer %v); log:\n%s", polled, tc.bouncer, logs.String())
			}
		})
	}
}
