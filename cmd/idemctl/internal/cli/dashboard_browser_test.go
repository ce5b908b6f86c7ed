package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestDashboardInBrowser drives headless Chromium against idemctl run
// --http --http-actions on a database filled by a storm: two sources
// claimed through idem.Client.Do by 16 goroutines, each event delivered 1
// to 4 times at once; 20 inbox events dead-lettered, 12 for a 422 and 8 for
// a timeout. Every page loads with no console error; the overview shows
// each source's exact duplicate rate; the dead letters of the 422 are
// filtered, replayed in the page (dry run, then confirmed) and each is
// processed once; two of the others are ticked and replayed; a form posted
// from another site changes nothing. Screenshots of each page go to
// $IDEM_SCREENSHOTS (docs/img for docs/dashboard.md) or a temporary
// directory.
func TestDashboardInBrowser(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 30)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling)
		VALUES ('stripe', '7 days', '1 minute', 1), ('github', '1 day', '1 minute', 1), ('shop', '30 days', '1 minute', 1)`); err != nil {
		t.Fatal(err)
	}

	// Earlier traffic, for charts a person would read: the 23 hours before
	// the last one, counted as claims count (idem.activity), with a spike
	// of duplicates 6 hours ago. The storm below is the last hour's only.
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.activity (minute, source, slot, acquired, duplicates)
		SELECT idem.activity_minute(idem.clock()) - m * interval '1 minute', s.source, 0,
		       s.base + (17 * m) % 23,
		       CASE WHEN m BETWEEN 330 AND 390 THEN (s.base + (17 * m) % 23) * 0.6 ELSE ((s.base + (17 * m) % 23) * (0.04 + ((7 * m) % 11) / 100.0)) END
		  FROM generate_series(62, 23 * 60) m, (VALUES ('stripe', 30), ('github', 12)) s(source, base)`); err != nil {
		t.Fatal(err)
	}

	// The storm.
	client, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	deliveries := map[string]int{}
	type job struct{ source, key string }
	var jobs []job
	r := rand.New(rand.NewPCG(1, 2))
	for _, src := range []struct {
		name   string
		events int
		maxDup int
	}{{"stripe", 300, 4}, {"github", 200, 2}} {
		for i := range src.events {
			n := 1 + r.IntN(src.maxDup)
			for range n {
				jobs = append(jobs, job{src.name, fmt.Sprintf("evt_%s_%04d", src.name, i)})
			}
			deliveries[src.name] += n
		}
	}
	r.Shuffle(len(jobs), func(i, j int) { jobs[i], jobs[j] = jobs[j], jobs[i] })
	work := make(chan job)
	var wg sync.WaitGroup
	var stormErr error
	var mu sync.Mutex
	for range 16 {
		wg.Go(func() {
			for j := range work {
				_, err := client.Do(ctx, j.source, j.key, func(context.Context) (any, error) { return map[string]bool{"ok": true}, nil })
				if err != nil && !errors.Is(err, idem.ErrInProgress) {
					mu.Lock()
					stormErr = err
					mu.Unlock()
				}
			}
		})
	}
	for _, j := range jobs {
		work <- j
	}
	close(work)
	wg.Wait()
	if stormErr != nil {
		t.Fatal(stormErr)
	}

	// The dead letters, and the worker that processes replays.
	var pmu sync.Mutex
	processed := map[string]int{}
	replaying := false
	in, err := inbox.New(inbox.Config{Pool: pool, Logger: slog.New(slog.DiscardHandler), Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		pmu.Lock()
		defer pmu.Unlock()
		if !replaying {
			if strings.HasPrefix(d.Key, "ord_t") {
				return nil, idem.Permanent(errors.New("POST https://erp.internal/orders: timeout after 30s"))
			}
			return nil, idem.Permanent(errors.New("erp answered 422: unknown customer"))
		}
		processed[d.Key]++
		return nil, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		key := fmt.Sprintf("ord_c%02d", i)
		if i >= 12 {
			key = fmt.Sprintf("ord_t%02d", i)
		}
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: key, EventType: "order.created", Payload: []byte(`{"card": "4242 4242 4242 4242"}`)}); err != nil {
			t.Fatal(err)
		}
	}
	rc, err := in.NewWorkerClient(4, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer func() {
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		_ = rc.Stop(sctx)
	}()
	dead := func(errorText string) int64 {
		n, err := in.CountDeadLetters(ctx, inbox.Filter{Source: "shop", ErrorContains: errorText})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitUntil(t, "20 dead letters", func() bool { return dead("") == 20 })
	pmu.Lock()
	replaying = true
	pmu.Unlock()

	// idemctl run --http --http-actions.
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr, "--http", "--http-actions"},
			&out, &errw, func(string) string { return "" })
	}()
	base := "http://" + addr
	waitUntil(t, "the daemon's dashboard and its first snapshot", func() bool {
		var runs int
		_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.runs WHERE job = 'snapshot'`).Scan(&runs)
		resp, err := http.Get(base + "/")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200 && runs > 0
	})

	// The browser.
	shots := os.Getenv("IDEM_SCREENSHOTS")
	if shots == "" {
		shots = t.TempDir()
	}
	actx, acancel := chromedp.NewExecAllocator(ctx, append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(testdb.Chromium(t)), chromedp.NoSandbox, chromedp.WindowSize(1280, 900),
		chromedp.Flag("disable-dev-shm-usage", true))...)
	defer acancel()
	bctx, bcancel := chromedp.NewContext(actx)
	defer bcancel()
	if err := chromedp.Do(bctx); err != nil { // starts the browser (no timeout on this first call)
		t.Fatal(err)
	}
	var consoleMu sync.Mutex
	var consoleErrors []string
	go func() {
		for m, err := range chromedp.Console(bctx) {
			if err != nil {
				return
			}
			if m.Type == chromedp.ConsoleError || m.Type == chromedp.ConsoleWarning || m.IsException() {
				consoleMu.Lock()
				consoleErrors = append(consoleErrors, m.String()+" at "+m.URL)
				consoleMu.Unlock()
			}
		}
	}()
	step := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		sctx, scancel := context.WithTimeout(bctx, 30*time.Second)
		defer scancel()
		if err := chromedp.Do(sctx, steps...); err != nil {
			t.Fatalf("%s: %v\n%s", what, err, errw.String())
		}
	}
	text := func(sel string) string {
		t.Helper()
		sctx, scancel := context.WithTimeout(bctx, 30*time.Second)
		defer scancel()
		s, err := chromedp.Run(sctx, chromedp.Text(chromedp.CSS(sel)))
		if err != nil {
			t.Fatalf("text of %s: %v", sel, err)
		}
		return strings.TrimSpace(s)
	}
	shot := func(name string) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			buf, err := chromedp.FullScreenshot(100)(ctx, tg) // 100: PNG
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(shots, "dashboard-"+name+".png"), buf, 0o644)
		})
	}
	css := func(s string) chromedp.CSS { return chromedp.CSS(s) }
	// clickThen clicks what navigates (a form's button) and waits for an
	// element of the next page; a query that meets the page mid-navigation
	// ("Not attached to an active page") is tried again.
	clickThen := func(what, click, next string) {
		t.Helper()
		step(what, chromedp.Click(css(click)))
		deadline := time.Now().Add(30 * time.Second)
		for {
			sctx, scancel := context.WithTimeout(bctx, 5*time.Second)
			err := chromedp.Do(sctx, chromedp.WaitVisible(css(next)))
			scancel()
			if err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: waiting for %s: %v\n%s", what, next, err, errw.String())
			}
			time.Sleep(50 * time.Millisecond)
		}
	}

	// Overview: each source's duplicate rate over the last hour is the
	// storm's, exact (sampling 1).
	step("overview", chromedp.Navigate(base+"/"), chromedp.WaitVisible(css("#source-stripe")))
	for src, n := range deliveries {
		var keys int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = $1`, src).Scan(&keys); err != nil {
			t.Fatal(err)
		}
		want := fmt.Sprintf("%.1f%%", 100*float64(n-keys)/float64(n))
		if got := text(`#source-` + src + ` [data-figure="rate-1h"]`); got != want {
			t.Errorf("%s: the overview shows a duplicate rate of %q, the storm's was %s (%d deliveries, %d keys)", src, got, want, n, keys)
		}
	}
	step("overview screenshot", shot("overview"))
	step("keys", chromedp.Navigate(base+"/keys?source=stripe"), chromedp.WaitVisible(css("table.list")), shot("keys"))
	step("key", chromedp.Navigate(base+"/keys?source=stripe&key=evt_stripe_0001"), chromedp.WaitVisible(css("table.record")))
	step("maintenance", chromedp.Navigate(base+"/maintenance"), chromedp.WaitVisible(css(`[data-job="snapshot"]`)), shot("maintenance"))

	// Dead letters: filter in the page, replay all that match, dry run
	// first, then confirmed.
	step("dead letters", chromedp.Navigate(base+"/dead"), chromedp.WaitVisible(css(`form.filters input[name="error"]`)),
		chromedp.SendKeys(css(`form.filters input[name="source"]`), "shop"),
		chromedp.SendKeys(css(`form.filters input[name="error"]`), "422"))
	// The filtered page, not the one the filter was typed in: only the
	// server's answer has the filter in the input's value attribute.
	clickThen("filter", `form.filters button`, `form.filters input[name="error"][value="422"]`)
	step("dead letters screenshot", shot("dead-letters"))
	if count := text(`[data-figure="dead-count"]`); count != "12" {
		t.Fatalf("the filter shows %s dead letters, want 12", count)
	}
	clickThen("dry run", `#replay-all`, `#confirm`)
	step("dry run screenshot", shot("replay-dry-run"))
	if dry := text(`[data-figure="dry-run-count"]`); dry != "12" || dead("") != 20 {
		t.Fatalf("the dry run counts %s (want 12) and left %d dead letters (want 20)", dry, dead(""))
	}
	clickThen("confirm", `#confirm`, `[data-figure="replay-summary"]`)
	step("replay screenshot", shot("replay-done"))
	if summary := text(`[data-figure="replay-summary"]`); !strings.Contains(summary, "12 replayed") {
		t.Fatalf("the replay says %q", summary)
	}
	waitUntil(t, "the 12 replayed events processed", func() bool {
		pmu.Lock()
		defer pmu.Unlock()
		return len(processed) == 12
	})
	if n := dead("422"); n != 0 || dead("") != 8 {
		t.Fatalf("after the replay: %d dead letters of the 422 and %d in all (want 0 and 8)", n, dead(""))
	}

	// Two ticked by hand.
	step("tick two", chromedp.Navigate(base+"/dead?source=shop&error=timeout"), chromedp.WaitVisible(css(`#replay-selected`)),
		chromedp.Click(css(`tbody tr:nth-child(1) input[name="k"]`)),
		chromedp.Click(css(`tbody tr:nth-child(2) input[name="k"]`)))
	clickThen("replay the ticked", `#replay-selected`, `#confirm`)
	if dry := text(`[data-figure="dry-run-count"]`); dry != "2" {
		t.Fatalf("ticking two: the dry run counts %q", dry)
	}
	clickThen("confirm two", `#confirm`, `[data-figure="replay-summary"]`)
	if summary := text(`[data-figure="replay-summary"]`); !strings.Contains(summary, "2 replayed") {
		t.Fatalf("ticking two: the replay says %q", summary)
	}
	waitUntil(t, "the 14 replayed events processed", func() bool {
		pmu.Lock()
		defer pmu.Unlock()
		return len(processed) == 14
	})

	// A form on another site posting a confirmed replay of the rest.
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `<!doctype html><title>prize</title><form method="post" action="%s/dead/replay">
<input type="hidden" name="source" value="shop"><input type="hidden" name="scope" value="all">
<input type="hidden" name="expected" value="6"><input type="hidden" name="confirm" value="1">
<button id="go" type="submit">Win a prize</button></form>`, base)
	}))
	defer evil.Close()
	evilURL := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1) // another site, not just another port
	step("cross-site form", chromedp.Navigate(evilURL), chromedp.WaitVisible(css(`#go`)))
	clickThen("cross-site post", `#go`, `body:not(:has(#go))`)
	if refused := text(`body`); !strings.Contains(refused, "cross-origin request refused") {
		t.Errorf("the cross-site form was answered %q", refused)
	}
	if n := dead(""); n != 6 {
		t.Fatalf("after the cross-site form: %d dead letters, want 6 (nothing changed)", n)
	}
	consoleMu.Lock()
	// The refused post is answered 403, which the browser logs as a
	// failed resource load on the attacker's page: expected there.
	var unexpected []string
	for _, e := range consoleErrors {
		if !strings.Contains(e, "403") {
			unexpected = append(unexpected, e)
		}
	}
	consoleMu.Unlock()
	if len(unexpected) > 0 {
		t.Errorf("console errors on the dashboard's pages: %v", unexpected)
	}

	// Each replayed event ran once; none of the others ran.
	pmu.Lock()
	for k, n := range processed {
		if n != 1 {
			t.Errorf("%s processed %d times", k, n)
		}
	}
	pmu.Unlock()
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Errorf("idemctl run exited %d: %s", c, errw.String())
		}
	case <-time.After(30 * time.Second):
		t.Error("idemctl run did not stop")
	}
}

// waitUntil polls cond until it holds or 60 seconds pass.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(25 * time.Millisecond) {
		if cond() {
			return
		}
	}
	t.Fatalf("timed out waiting for %s", what)
}
