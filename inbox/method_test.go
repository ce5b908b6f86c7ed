package inbox_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestFromHTTPMethodAndPrincipal: PATCH, PUT and DELETE /orders/42,
// routed by method patterns ("PATCH /orders/{id}"), scoped by the
// principal the application's authentication named, are accepted with 202
// and reach the handler behind the inbox with their method, route value
// and principal (idemhttp.Principal), as they do synchronously: the
// handler is written once. Before, every delivery was replayed as POST: it
// matched none of the method patterns, reached the handler with no path
// value and no principal, and the update was never made.
//
// A dead letter replayed is replayed the same way. A job accepted by an
// earlier version (its arguments without "method" or
// "principal", as that version wrote them) is still read and replayed,
// as POST at its target, as it was then.
func TestFromHTTPMethodAndPrincipal(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	type seen struct{ method, id, principal, body, pattern string }
	got := make(chan seen, 10)
	var failed atomic.Bool
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		got <- seen{r.Method, r.PathValue("id"), idemhttp.Principal(r.Context()), string(body), r.Pattern}
		if strings.Contains(string(body), "fail") && failed.CompareAndSwap(false, true) {
			http.Error(w, "failing once", http.StatusInternalServerError)
			return
		}
		if r.PathValue("id") == "" || idemhttp.Principal(r.Context()) == "" {
			http.Error(w, "no order id or no principal", http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	})
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, DefaultMaxAttempts: 1})
	if err != nil {
		t.Fatal(err)
	}
	type user struct{}
	orders, err := in.HTTP(idemhttp.Config{Client: testdb.Client(t, pool, nil), Source: "orders",
		Scope: func(r *http.Request) (string, error) {
			if u, ok := r.Context().Value(user{}).(string); ok {
				return u, nil
			}
			return "", idemhttp.ErrNoPrincipal
		}}, h)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	for _, m := range []string{"PATCH", "PUT", "DELETE"} {
		mux.Handle(m+" /orders/{id}", orders)
	}
	// The application's authentication: a bearer token names the user.
	auth := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if u, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			r = r.WithContext(context.WithValue(r.Context(), user{}, u))
		}
		mux.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(auth)
	t.Cleanup(srv.Close)
	start(t, in, 2, nil)

	send := func(method, path, key, body string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Authorization", "Bearer alice")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("%s %s: %d, want 202", method, path, resp.StatusCode)
		}
	}
	reached := func(want seen) {
		t.Helper()
		select {
		case s := <-got:
			if s != want {
				t.Fatalf("the request reached the handler as %+v, want %+v", s, want)
			}
		case <-time.After(30 * time.Second):
			dead, _ := in.DeadLetters(context.Background(), inbox.Filter{})
			t.Fatalf("%+v never reached the handler; dead letters %+v", want, dead)
		}
	}
	for _, m := range []string{"PATCH", "PUT", "DELETE"} {
		body := `{"qty":2,"via":"` + m + `"}`
		send(m, "/orders/42", "k-"+m, body)
		reached(seen{m, "42", "alice", body, m + " /orders/{id}"})
	}
	waitFor(t, "the three events processed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'orders' AND status = 'completed'`) == 3
	})
	// The principal and method are kept with the job: an identifier, no
	// credential.
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE args->>'principal' = 'alice' AND args ? 'method'`); n != 3 {
		t.Fatalf("%d jobs keep their method and principal", n)
	}
	// A dead letter replayed is the same request again.
	send("PUT", "/orders/43", "k-fail", `{"fail":true}`)
	reached(seen{"PUT", "43", "alice", `{"fail":true}`, "PUT /orders/{id}"})
	waitFor(t, "the dead letter", func() bool {
		dead, err := in.DeadLetters(context.Background(), inbox.Filter{Source: "orders"})
		return err == nil && len(dead) == 1
	})
	if res, err := in.Replay(context.Background(), inbox.Filter{Source: "orders", Key: idem.ScopeKey("alice", "k-fail")}); err != nil || len(res) != 1 {
		t.Fatalf("replay: %+v %v", res, err)
	}
	reached(seen{"PUT", "43", "alice", `{"fail":true}`, "PUT /orders/{id}"})
	if n := count(t, pool, `SELECT count(*) FROM river_job WHERE args::text LIKE '%Bearer%'`); n != 0 {
		t.Fatalf("%d jobs hold the credential", n)
	}

	// An earlier version's job: its arguments made exactly what that
	// version wrote (no method, no principal) in the transaction that
	// inserts it. It matches no method pattern and reaches the handler
	// through the "/" fallback, as every job did then.
	old, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	a, err := old.AcceptTx(context.Background(), tx, &inbox.Delivery{Source: "orders", Key: "old-job", Payload: []byte(`{"qty":3}`),
		Method: "PATCH", Target: "/orders/7", Pattern: "PATCH /orders/{id}", Principal: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(context.Background(), `UPDATE river_job SET args = args - 'method' - 'principal' WHERE id = $1`, a.JobID); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(context.Background()); err != nil {
		t.Fatal(err)
	}
	select {
	case s := <-got:
		if want := (seen{"POST", "", "", `{"qty":3}`, "/"}); s != want {
			t.Fatalf("an earlier version's job reached the handler as %+v, want %+v", s, want)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("an earlier version's job never reached the handler")
	}
}
