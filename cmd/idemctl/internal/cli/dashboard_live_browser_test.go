package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// retryInAnHour keeps a failed job retrying, its next attempt an hour
// away, for the jobs page to show.
type retryInAnHour struct{}

func (retryInAnHour) NextRetry(*rivertype.JobRow) time.Time { return time.Now().Add(time.Hour) }

// TestDashboardLiveInBrowser drives headless Chromium against idemctl run
// --http on nine sources under the default policy (exact counts below the
// sampling rate) and an inbox with a retrying job and dead letters: the
// summary table has the nine sources, each linking to its card; the
// overview, left open, shows a source's claims per minute change after a
// storm without a reload (the live script), marking what changed; the jobs
// page shows the retrying job with its next attempt and last error, and
// the dead ones; a dead letter's timeline tells its story in order; at 700
// px wide no page scrolls sideways. Screenshots go to $IDEM_SCREENSHOTS
// (docs/img for docs/dashboard.md) or a temporary directory.
func TestDashboardLiveInBrowser(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 20)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	sources := []string{"stripe", "github", "shopify", "twilio", "slack", "paypal", "sendgrid", "intercom", "shop"}
	client, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	claim := func(source string, n, dups int) {
		t.Helper()
		for i := range n {
			for range 1 + dups {
				if _, err := client.Do(ctx, source, fmt.Sprintf("evt_%04d", i), func(context.Context) (any, error) { return nil, nil }); err != nil && !errors.Is(err, idem.ErrInProgress) {
					t.Fatal(err)
				}
			}
		}
	}
	for i, s := range sources[:8] {
		claim(s, 5+7*i, i%3)
	}

	// The inbox: ord_r00 keeps failing (retrying, its next attempt an
	// hour away), ord_d* fail for good (dead letters) until fixed, the
	// others succeed.
	var fixed atomic.Bool
	in, err := inbox.New(inbox.Config{Pool: pool, Logger: slog.New(slog.DiscardHandler), RetryPolicy: retryInAnHour{}, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		switch {
		case strings.HasPrefix(d.Key, "ord_r"):
			return nil, errors.New("POST https://erp.internal/orders: 503 Service Unavailable")
		case strings.HasPrefix(d.Key, "ord_d") && !fixed.Load():
			return nil, idem.Permanent(errors.New("erp answered 422: unknown customer"))
		}
		return nil, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"ord_r00", "ord_d00", "ord_d01", "ord_d02", "ord_ok0", "ord_ok1"} {
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: k, EventType: "order.created", Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	rc, err := in.NewWorkerClient(2, nil)
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
	waitUntil(t, "3 dead letters and a retrying job", func() bool {
		var dead, retrying int
		_ = pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE state = 'cancelled'), count(*) FILTER (WHERE state = 'retryable') FROM river_job`).Scan(&dead, &retrying)
		return dead == 3 && retrying == 1
	})

	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr, "--http"}, &out, &errw, func(string) string { return "" })
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
	if err := chromedp.Do(bctx); err != nil {
		t.Fatal(err)
	}
	var consoleMu sync.Mutex
	var consoleErrors []string
	go func() {
		for m, err := range chromedp.Console(bctx) {
			if err != nil {
				return
			}
			if m.Type == chromedp.ConsoleError || m.IsException() {
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
	eval := func(js string) string {
		t.Helper()
		sctx, scancel := context.WithTimeout(bctx, 30*time.Second)
		defer scancel()
		s, err := chromedp.Run(sctx, chromedp.Evaluate[string](js))
		if err != nil {
			t.Fatalf("%s: %v", js, err)
		}
		return s
	}
	// shot writes the page (the viewport only, for the overview's long
	// list of cards).
	shot := func(name string) chromedp.Action[chromedp.Void] {
		return chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			take := chromedp.FullScreenshot(100)
			if strings.HasPrefix(name, "overview") || name == "summary" {
				take = chromedp.CaptureScreenshot()
			}
			buf, err := take(ctx, tg)
			if err != nil {
				return err
			}
			return os.WriteFile(filepath.Join(shots, "dashboard-"+name+".png"), buf, 0o644)
		})
	}
	css := func(s string) chromedp.CSS { return chromedp.CSS(s) }

	// The summary: nine sources, each row linking to its card.
	step("overview", chromedp.Navigate(base+"/"), chromedp.WaitVisible(css("#summary")))
	if rows := eval(`String(document.querySelectorAll("#summary tbody tr").length)`); rows != "9" {
		t.Errorf("the summary table has %s rows, want 9", rows)
	}
	if links := eval(`[...document.querySelectorAll("#summary tbody tr td:first-child a")].filter(a => document.querySelector(a.getAttribute("href"))).length + ""`); links != "9" {
		t.Errorf("%s of the summary's rows link to a card, want 9", links)
	}
	step("summary screenshot", shot("summary"))

	// Live: the overview left open shows the storm's claims without a
	// reload.
	sel := `#row-stripe [data-figure="claims-per-minute"]`
	before := eval(`document.querySelector('` + sel + `').textContent.trim()`)
	eval(`window.notReloaded = "yes"; "ok"`)
	claim("stripe", 300, 1)
	waitUntil(t, "the overview's claims per minute to change without a reload", func() bool {
		return eval(`document.querySelector('`+sel+`').textContent.trim()`) != before
	})
	if eval(`window.notReloaded || "reloaded"`) != "yes" {
		t.Error("the page was reloaded")
	}
	if marked := eval(`String(document.querySelectorAll(".changed").length)`); marked == "0" {
		t.Error("nothing that changed is marked")
	}
	if badge := eval(`document.getElementById("live").textContent`); !strings.HasPrefix(badge, "live") {
		t.Errorf("the live badge says %q", badge)
	}
	t.Logf("stripe's claims per minute: %s, then %s", before, eval(`document.querySelector('`+sel+`').textContent.trim()`))
	step("live screenshot", shot("overview-live"))

	// Jobs by state.
	step("jobs", chromedp.Navigate(base+"/jobs"), chromedp.WaitVisible(css(`#jobs-retryable tr[data-job]`)))
	if next := eval(`document.querySelector('#jobs-retryable [data-figure="next-attempt"]').textContent`); !strings.Contains(next, "in ") {
		t.Errorf("the retrying job's next attempt: %q", next)
	}
	if e := eval(`document.querySelector('#jobs-retryable .error-text').textContent`); !strings.Contains(e, "503 Service Unavailable") {
		t.Errorf("the retrying job's last error: %q", e)
	}
	if dead := eval(`String(document.querySelectorAll('#jobs-cancelled tr[data-job]').length)`); dead != "3" {
		t.Errorf("%s dead jobs listed, want 3", dead)
	}

	// A replay, with the jobs page open: the replayed job appears, marked
	// as a replay, and moves to completed without a reload.
	eval(`window.notReloaded = "yes"; "ok"`)
	fixed.Store(true)
	if res, err := in.Replay(ctx, inbox.Filter{Source: "shop", Key: "ord_d00", Limit: 1}); err != nil || len(res) != 1 || res[0].Outcome != "replayed" {
		t.Fatalf("replay: %v %+v", err, res)
	}
	for deadline := time.Now().Add(60 * time.Second); eval(`String(!!document.querySelector('#jobs-completed tr.replay[data-state="completed"]'))`) != "true"; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			rows, _ := pool.Query(ctx, `SELECT id::text || ' ' || state::text || ' ' || metadata::text FROM river_job ORDER BY id`)
			jobs, _ := pgx.CollectRows(rows, pgx.RowTo[string])
			t.Fatalf("the replayed job did not show as completed on the open jobs page: badge %q, jobs %v\n%s", eval(`document.getElementById("live").textContent`), jobs,
				eval(`document.querySelector("#jobs-completed").outerHTML`))
		}
	}
	if eval(`window.notReloaded || "reloaded"`) != "yes" {
		t.Error("the jobs page was reloaded")
	}
	if eval(`String(!!document.querySelector('#jobs-completed tr.replay.changed'))`) != "true" {
		t.Error("the replayed job's row is not marked as changed")
	}
	step("jobs screenshot", shot("jobs"))

	// A dead letter's timeline, and a replayed one's.
	step("timeline", chromedp.Navigate(base+"/timeline?source=shop&key=ord_d01"), chromedp.WaitVisible(css(`#timeline`)))
	story := eval(`[...document.querySelectorAll("#timeline li .what")].map(e => e.textContent).join(" | ")`)
	for _, want := range []string{"first seen", "held by the inbox", "job 3 enqueued", "job 3 attempt 1 failed", "dead-lettered", "job 3 cancelled"} {
		if !strings.Contains(story, want) {
			t.Errorf("the dead letter's timeline has no %q: %s", want, story)
		}
	}
	step("timeline screenshot", shot("timeline"))
	step("replayed timeline", chromedp.Navigate(base+"/timeline?source=shop&key=ord_d00"), chromedp.WaitVisible(css(`#timeline`)))
	story = eval(`[...document.querySelectorAll("#timeline li .what")].map(e => e.textContent).join(" | ")`)
	for _, want := range []string{"first seen", "replayed: job", "replacing the dead letter's job 2", "completed"} {
		if !strings.Contains(story, want) {
			t.Errorf("the replayed event's timeline has no %q: %s", want, story)
		}
	}

	// 700 px wide: nothing scrolls sideways.
	step("700 px", chromedp.EmulateViewport(700, 900))
	for _, page := range []string{"/", "/jobs", "/timeline?source=shop&key=ord_d01", "/dead", "/keys?source=stripe", "/keys?source=stripe&key=evt_0001", "/maintenance"} {
		step("700 px "+page, chromedp.Navigate(base+page), chromedp.WaitVisible(css("main")))
		if fits := eval(`String(document.documentElement.scrollWidth <= document.documentElement.clientWidth)`); fits != "true" {
			t.Errorf("%s at 700 px: scrollWidth %s > clientWidth %s", page, eval(`String(document.documentElement.scrollWidth)`), eval(`String(document.documentElement.clientWidth)`))
		}
		if page == "/" {
			step("700 px screenshot", shot("overview-700"))
		}
	}
	consoleMu.Lock()
	if len(consoleErrors) > 0 {
		t.Errorf("console errors: %v", consoleErrors)
	}
	consoleMu.Unlock()
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
