package idemtest_test

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

var swSecret = "whsec_" + base64.StdEncoding.EncodeToString([]byte("idemtest genuine key 0123456789"))

// TestSenders: for each preset, the helper's deliveries are what the
// preset expects. A genuine event, fired 20 times at once, runs the
// handler once (the copies that lose the race get 409, the preset's
// in-flight answer, or the replay); its redelivery is replayed; a forged
// copy is refused; 10 distinct events each run once; a copy under a fresh
// delivery id runs nothing for the body-signed senders.
func TestSenders(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		sender *idemtest.Sender
		preset idemhttp.Preset
		// resendRuns: whether a Resend is a new event for the preset.
		resendRuns bool
	}{
		{idemtest.Stripe("whsec_idemtest"), idemhttp.Stripe("whsec_idemtest"), false},
		{idemtest.GitHub("gh secret"), idemhttp.GitHub("gh secret"), false},
		{idemtest.Shopify("shpss_idemtest"), idemhttp.Shopify("shpss_idemtest"), false},
		{idemtest.StandardWebhooks(swSecret), idemhttp.StandardWebhooks(swSecret), true},
	} {
		ev := tc.sender.Event("thing.happened", `{"id":"obj_1"}`)
		t.Run(ev.Sender, func(t *testing.T) {
			t.Parallel()
			pool := testdb.Pool(t, testdb.New(t), 30)
			runs := idemtest.Count(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				time.Sleep(50 * time.Millisecond) // in flight while the copies arrive
				w.Write([]byte("done\n"))
			}))
			mw, err := idemhttp.New(idemhttp.Config{Client: testdb.Client(t, pool, nil)}.Apply(tc.preset))
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(runs))
			t.Cleanup(srv.Close)

			codes := idemtest.Fire(t, srv.URL, ev, 20)
			if i := slices.IndexFunc(codes, func(c int) bool { return c != 200 && c != 409 }); i >= 0 {
				t.Fatalf("codes %v", codes)
			}
			runs.AssertOnce(t, ev)
			// Retention: the Stripe preset keeps keys 7 days (docs/http.md),
			// the others the default policy's 30.
			var days float64
			if err := pool.QueryRow(context.Background(), `SELECT extract(epoch FROM expires_at - first_seen) / 86400 FROM idem.processed_events LIMIT 1`).Scan(&days); err != nil ||
				days != map[bool]float64{true: 7, false: 30}[ev.Sender == "stripe"] {
				t.Fatalf("keys kept %v days (%v)", days, err)
			}

			resp, body := idemtest.Send(t, srv.URL, tc.sender.Redeliver(ev))
			if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" || string(body) != "done\n" {
				t.Fatalf("redelivery: %d %q %q", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader), body)
			}
			if resp, _ := idemtest.Send(t, srv.URL, tc.sender.Forge(ev)); resp.StatusCode != 401 {
				t.Fatalf("forged: %d", resp.StatusCode)
			}
			var evs []*idemtest.Delivery
			for range 10 {
				evs = append(evs, tc.sender.Event("thing.happened", ""))
			}
			if codes := idemtest.FireAll(t, srv.URL, evs...); slices.ContainsFunc(codes, func(c int) bool { return c != 200 }) {
				t.Fatalf("distinct events: %v", codes)
			}
			runs.AssertOnce(t, append(evs, ev)...)

			before := runs.Total()
			resp, _ = idemtest.Send(t, srv.URL, tc.sender.Resend(ev))
			if ran := runs.Total() - before; ran != map[bool]int{true: 1, false: 0}[tc.resendRuns] || resp.StatusCode != 200 {
				t.Fatalf("resend: %d, ran %d", resp.StatusCode, ran)
			}
		})
	}
}

// TestWaitRuns: WaitRuns returns once the handler ran that often, and
// Runs counts per event (its body).
func TestWaitRuns(t *testing.T) {
	t.Parallel()
	runs := idemtest.Count(nil)
	srv := httptest.NewServer(runs)
	t.Cleanup(srv.Close)
	ev := idemtest.Stripe("whsec_x").Event("a", "")
	go func() {
		time.Sleep(20 * time.Millisecond)
		req, _ := ev.Request(context.Background(), srv.URL)
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
		}
	}()
	runs.WaitRuns(t, 1, 10*time.Second)
	if runs.Of(ev) != 1 || runs.Total() != 1 {
		t.Fatalf("of %d total %d", runs.Of(ev), runs.Total())
	}
}

// TestOnReplay: every replayed answer goes through Config.OnReplay, with
// why, and carries Idempotency-Replayed; the first run does not.
func TestOnReplay(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 8)
	var mu sync.Mutex
	var seen []idemhttp.Replay
	mw, err := idemhttp.New(idemhttp.Config{Client: testdb.Client(t, pool, nil), OnReplay: func(r *http.Request, h http.Header, rp idemhttp.Replay) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, rp)
		h.Set("X-Replay-Why", rp.Why)
	}}.Apply(idemhttp.GitHub("gh")))
	if err != nil {
		t.Fatal(err)
	}
	runs := idemtest.Count(nil)
	srv := httptest.NewServer(mw(runs))
	t.Cleanup(srv.Close)
	gh := idemtest.GitHub("gh")
	ev := gh.Event("push", "")
	for i, tc := range []struct {
		d   *idemtest.Delivery
		why string
	}{{ev, ""}, {gh.Redeliver(ev), idemhttp.ReplayStored}, {gh.Resend(ev), idemhttp.ReplayCopy}} {
		resp, _ := idemtest.Send(t, srv.URL, tc.d)
		replayed := resp.Header.Get(idemhttp.ReplayedHeader) == "true"
		if resp.StatusCode != 200 || replayed != (tc.why != "") || resp.Header.Get("X-Replay-Why") != tc.why {
			t.Fatalf("delivery %d: %d replayed %v why %q", i+1, resp.StatusCode, replayed, resp.Header.Get("X-Replay-Why"))
		}
	}
	runs.AssertOnce(t, ev)
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 2 || seen[0].Source != "github" || seen[0].Status != 200 || seen[1].Why != idemhttp.ReplayCopy {
		t.Fatalf("OnReplay saw %+v", seen)
	}
}
