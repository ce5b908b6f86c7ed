package inbox_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/inbox"
)

// TestOneLineSetup: Inbox.HTTP wraps each sender's handler once, for
// both modes' roles: the web side verifies, accepts and answers 202, the
// worker runs that same handler for that source only. Each of 5 Stripe
// and 5 GitHub events, fired 8 times at once (and a GitHub copy under a
// fresh delivery id), runs its own handler once. A source with no handler
// in the worker is dead-lettered with ErrNoHandler's reason, never
// completed unrun; the setup's mistakes are errors.
func TestOneLineSetup(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, MaxAttempts: map[string]int{"shopify": 2}})
	if err != nil {
		t.Fatal(err)
	}
	stripeRuns, githubRuns := idemtest.Count(nil), idemtest.Count(nil)
	var replays atomic.Int64
	onReplay := func(_ *http.Request, _ http.Header, rp idemhttp.Replay) {
		if rp.Why == idemhttp.ReplayAccepted && rp.Status == http.StatusAccepted {
			replays.Add(1)
		}
	}
	stripeH, err := in.HTTP(idemhttp.Config{Client: c, OnReplay: onReplay}.Apply(idemhttp.Stripe("whsec_one")), stripeRuns)
	if err != nil {
		t.Fatal(err)
	}
	githubH, err := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.GitHub("gh one")), githubRuns)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /stripe", stripeH)
	mux.Handle("POST /github", githubH)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	stripe, github := idemtest.Stripe("whsec_one"), idemtest.GitHub("gh one")
	var stripeEvs, githubEvs []*idemtest.Delivery
	for range 5 {
		s, g := stripe.Event("invoice.paid", ""), github.Event("issues", "")
		stripeEvs, githubEvs = append(stripeEvs, s), append(githubEvs, g)
		codes := append(idemtest.Fire(t, srv.URL+"/stripe", s, 8), idemtest.Fire(t, srv.URL+"/github", g, 8)...)
		codes = append(codes, idemtest.FireAll(t, srv.URL+"/github", github.Resend(g))...)
		if slices.ContainsFunc(codes, func(c int) bool { return c != http.StatusAccepted }) {
			t.Fatalf("answers %v, want 202 each", codes)
		}
	}
	if stripeRuns.Total()+githubRuns.Total() != 0 {
		t.Fatal("a handler ran on the web side")
	}
	if n := replays.Load(); n != 5*7 {
		t.Fatalf("OnReplay saw %d accepted-before duplicates of Stripe events, want 35", n)
	}
	start(t, in, 4, nil)
	stripeRuns.WaitRuns(t, 5, time.Minute)
	githubRuns.WaitRuns(t, 5, time.Minute)
	waitFor(t, "the events completed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source IN ('stripe', 'github') AND status = 'completed'`) == 10
	})
	stripeRuns.AssertOnce(t, stripeEvs...)
	githubRuns.AssertOnce(t, githubEvs...)
	if stripeRuns.Total() != 5 || githubRuns.Total() != 5 {
		t.Fatalf("runs: stripe %d, github %d, want 5 each (each source's own handler)", stripeRuns.Total(), githubRuns.Total())
	}

	// No handler for shopify in this process: dead-lettered, saying so.
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shopify", Key: "no-route", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the unrouted event dead-lettered", func() bool {
		dl, err := in.DeadLetters(ctx, inbox.Filter{Source: "shopify"})
		return err == nil && len(dl) == 1 && strings.Contains(dl[0].LastError, `no handler`) && strings.Contains(dl[0].LastError, `"shopify"`)
	})

	// Mistakes in the setup.
	if _, err := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe("whsec_one")), stripeRuns); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("a second handler for stripe: %v", err)
	}
	other, _ := inbox.New(inbox.Config{Pool: pool})
	if _, err := in.HTTP(idemhttp.Config{Client: c, Async: other}.Apply(idemhttp.Shopify("s")), stripeRuns); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("another inbox as Async: %v", err)
	}
	if _, err := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.Shopify()), stripeRuns); err == nil || !strings.Contains(err.Error(), "secret") {
		t.Errorf("a preset without its secret: %v", err)
	}
	if err := in.Handle("", nil); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("Handle without a source: %v", err)
	}
	if _, err := other.NewWorkerClient(1, nil); !errors.Is(err, inbox.ErrNoHandler) {
		t.Errorf("a worker with no handler at all: %v", err)
	}
}

// TestWorkerOnlyProcess: the two sides of the asynchronous setup, each
// explicit, in two "processes" (two inboxes on one database): the web side
// (Middleware) verifies, accepts and answers 202 and routes nothing, so it
// has no worker to run; the worker side (HandleHTTP) runs the source's
// handler for each accepted delivery, and builds no HTTP handler.
func TestWorkerOnlyProcess(t *testing.T) {
	t.Parallel()
	_, pool := setup(t)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	web, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := web.Middleware(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe("whsec_split")))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	t.Cleanup(srv.Close)
	if _, err := web.NewWorkerClient(0, nil); !errors.Is(err, inbox.ErrNoHandler) {
		t.Fatalf("the web side registered a route: NewWorkerClient = %v, want ErrNoHandler", err)
	}

	runs := idemtest.Count(nil)
	worker, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	if err := worker.HandleHTTP("stripe", runs); err != nil {
		t.Fatal(err)
	}
	start(t, worker, 0, nil)

	stripe := idemtest.Stripe("whsec_split")
	var evs []*idemtest.Delivery
	for range 3 {
		ev := stripe.Event("invoice.paid", "")
		evs = append(evs, ev)
		if codes := idemtest.Fire(t, srv.URL, ev, 4); slices.ContainsFunc(codes, func(c int) bool { return c != http.StatusAccepted }) {
			t.Fatalf("answers %v, want 202 each", codes)
		}
	}
	runs.WaitRuns(t, 3, time.Minute)
	runs.AssertOnce(t, evs...)

	for _, bad := range []struct {
		source string
		h      http.Handler
	}{{"", runs}, {"github", nil}, {"stripe", runs}} {
		if err := worker.HandleHTTP(bad.source, bad.h); !errors.Is(err, inbox.ErrInvalidConfig) {
			t.Errorf("HandleHTTP(%q, %v): %v, want ErrInvalidConfig", bad.source, bad.h, err)
		}
	}
	other, _ := inbox.New(inbox.Config{Pool: pool})
	if _, err := worker.Middleware(idemhttp.Config{Client: c, Async: other}.Apply(idemhttp.Stripe("s"))); !errors.Is(err, inbox.ErrInvalidConfig) {
		t.Errorf("Middleware with another inbox as Async: %v", err)
	}
}
