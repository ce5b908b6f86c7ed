package demo_test

import (
	"context"
	"log/slog"
	"testing"

	"github.com/idemkit/idem/cmd/idemctl/internal/demo"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// TestTimeoutStorm: a handler that takes 5 s behind a sender that gives up
// after 2 s and retries. Asynchronously, every delivery is answered at
// once: no timeouts, no retries, each event processed once. Synchronously,
// for comparison, the sender times out and retries (idem still runs each
// event once). The latencies are reported, not asserted (make bench and
// idemctl demo print them; docs/inbox.md has a run's figures).
func TestTimeoutStorm(t *testing.T) {
	t.Parallel()
	for _, async := range []bool{true, false} {
		name := map[bool]string{true: "async", false: "sync"}[async]
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			pool := testdb.Pool(t, testdb.New(t), 40)
			rep, err := demo.Timeouts(context.Background(), pool, demo.TimeoutsConfig{Async: async}, slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: %d requests, %d timeouts, %d retries, %d non-2xx; p50 %v p99 %v max %v; %d of %d events processed once, %d more than once; all processed after %v",
				rep.Mode, rep.Requests, rep.Timeouts, rep.Retries, rep.Non2xx, rep.P50, rep.P99, rep.Max, rep.ProcessedOnce, rep.Events, rep.Repeat, rep.Elapsed)
			if !rep.OnceEach() {
				t.Fatalf("%d of %d processed once, %d more than once", rep.ProcessedOnce, rep.Events, rep.Repeat)
			}
			if async && !rep.AsyncOK() {
				t.Fatalf("asynchronous mode: %d timeouts, %d retries, %d non-2xx; want none", rep.Timeouts, rep.Retries, rep.Non2xx)
			}
			if async && !rep.ReconcileOK() {
				t.Fatalf("asynchronous mode's reconciliation: %v", rep.Inbox)
			}
			if !async && rep.Timeouts == 0 {
				t.Fatal("synchronous mode showed no timeouts: the comparison is void")
			}
		})
	}
}
