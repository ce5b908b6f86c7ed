package dashboard_test

import (
	"strings"
	"testing"

	"github.com/idemkit/idem/dashboard"
)

// TestLivePages: the overview has the summary table (a row per source,
// linking to its card; sorted by a column on request, without script),
// the live script and its noscript note; the jobs page lists the inbox's
// jobs by state (the dead ones with their error, linking to their
// timeline); a dead letter's timeline has its first claim, its job's
// failed attempt and its dead-lettering, in time order.
func TestLivePages(t *testing.T) {
	t.Parallel()
	f := setup(t)
	srv := serve(t, dashboard.Config{Pool: f.pool, Inbox: f.in})

	code, body := get(t, srv.URL+"/")
	if code != 200 {
		t.Fatalf("/: %d", code)
	}
	contains(t, "/", body, `id="summary"`, `<a href="#source-web">web</a>`, `<a href="#source-shop">shop</a>`,
		`/static/live.js`, `<noscript>`, `data-live="5"`)
	_, body = get(t, srv.URL+"/?sort=dead&dir=desc")
	if i, j := strings.Index(body, `id="row-shop"`), strings.Index(body, `id="row-web"`); i < 0 || j < 0 || i > j {
		t.Errorf("sorted by dead letters, descending: shop (5) is not before web (0)")
	}
	_, body = get(t, srv.URL+"/?sort=dead&dir=asc")
	if i, j := strings.Index(body, `id="row-shop"`), strings.Index(body, `id="row-web"`); i < 0 || j < 0 || i < j {
		t.Errorf("sorted by dead letters, ascending: web is not before shop")
	}
	if code, js := get(t, srv.URL+"/static/live.js"); code != 200 || !strings.Contains(js, "visibilitychange") {
		t.Errorf("/static/live.js: %d", code)
	}

	code, body = get(t, srv.URL+"/jobs")
	if code != 200 {
		t.Fatalf("/jobs: %d %s", code, body)
	}
	contains(t, "/jobs", body, `data-figure="jobs-cancelled">5</span>`, `upstream said 422: unknown customer`,
		`/timeline?source=shop&amp;key=evt_a`, `data-state="cancelled"`)

	code, body = get(t, srv.URL+"/timeline?source=shop&key=evt_a")
	if code != 200 {
		t.Fatalf("/timeline: %d %s", code, body)
	}
	first := strings.Index(body, "first seen: claimed")
	failed := strings.Index(body, "attempt 1 failed")
	dead := strings.Index(body, "dead-lettered")
	if first < 0 || failed < 0 || dead < 0 || !(first < failed && failed < dead) {
		t.Errorf("the timeline is not first seen, failed attempt, dead-lettered in order (%d, %d, %d):\n%s", first, failed, dead, body)
	}
	if code, _ := get(t, srv.URL+"/timeline?source=shop"); code != 400 {
		t.Errorf("a timeline without a key: %d, want 400", code)
	}
	if code, _ := get(t, srv.URL+"/timeline?source=shop&key=a%00b"); code != 400 {
		t.Errorf("a timeline for a key with a NUL byte: %d, want 400", code)
	}
}
