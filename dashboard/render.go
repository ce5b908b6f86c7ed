package dashboard

import (
	"bytes"
	"context"
	"embed"
	"fmt"
	"html/template"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem/db/pgxdb"
)

//go:embed templates/*.html
var templateFS embed.FS

// staticFS holds static/ (served as /static/...).
//
//go:embed static
var staticFS embed.FS

var funcs = template.FuncMap{
	"num":    formatInt,
	"pct":    formatPct,
	"bytes":  formatBytes,
	"ts":     formatTime,
	"ago":    formatAgo,
	"trunc":  truncate,
	"dur":    formatDuration,
	"add":    func(a, b int64) int64 { return a + b },
	"int64":  func(n int) int64 { return int64(n) },
	"sub":    func(a, b int64) int64 { return a - b },
	"keyref": keyRef,
	"ms":     func(n int64) time.Duration { return time.Duration(n) * time.Millisecond },
}

// pages are parsed once: the layout with each page's content.
var pages = func() map[string]*template.Template {
	m := map[string]*template.Template{}
	for _, name := range []string{"overview", "keys", "dead", "confirm", "replayed", "maintenance", "error", "jobs", "timeline"} {
		m[name] = template.Must(template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/"+name+".html"))
	}
	return m
}()

// view is what every page's layout reads.
type view struct {
	Prefix  string
	Title   string
	Section string // the nav entry to mark
	Now     time.Time
	Actions bool
	// Live: the page refreshes itself (static/live.js) while its tab is
	// visible; without script it is a plain page.
	Live bool
	Data any
}

// render writes a page; a template error is logged and answered 500 (the
// page is rendered into a buffer first, so nothing half-written goes out).
func (d *Dashboard) render(w http.ResponseWriter, r *http.Request, status int, name, section, title string, now time.Time, data any) {
	d.renderView(w, r, status, name, view{Prefix: d.cfg.Prefix, Title: title, Section: section, Now: now, Actions: d.cfg.Actions, Data: data})
}

// renderLive renders a page that refreshes itself (view.Live).
func (d *Dashboard) renderLive(w http.ResponseWriter, r *http.Request, status int, name, section, title string, now time.Time, data any) {
	d.renderView(w, r, status, name, view{Prefix: d.cfg.Prefix, Title: title, Section: section, Now: now, Actions: d.cfg.Actions, Live: true, Data: data})
}

func (d *Dashboard) renderView(w http.ResponseWriter, r *http.Request, status int, name string, v view) {
	var buf bytes.Buffer
	if err := pages[name].Execute(&buf, v); err != nil {
		d.log.LogAttrs(r.Context(), slog.LevelError, "dashboard: render", slog.String("page", name), slog.Any("error", err))
		http.Error(w, "the page could not be rendered (see the server's log)", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail answers a failed query: the page says the database could not be
// read, the log says why (a driver's error may name hosts and users, which
// the page does not show).
func (d *Dashboard) fail(w http.ResponseWriter, r *http.Request, what string, err error) {
	status := http.StatusInternalServerError
	msg := "the database could not be read (see the server's log)"
	if r.Context().Err() == nil && errorsIsDeadline(err) {
		status, msg = http.StatusGatewayTimeout, "the database did not answer in time (see the server's log)"
	}
	d.log.LogAttrs(r.Context(), slog.LevelError, "dashboard: query failed", slog.String("what", what), slog.Any("error", err))
	d.render(w, r, status, "error", "", "Error", time.Now(), map[string]string{"What": what, "Message": msg})
}

// badRequest answers a form value that makes no sense, naming it.
func (d *Dashboard) badRequest(w http.ResponseWriter, r *http.Request, section, format string, a ...any) {
	d.render(w, r, http.StatusBadRequest, "error", section, "Bad request", time.Now(),
		map[string]string{"What": "bad request", "Message": fmt.Sprintf(format, a...)})
}

// checkText refuses a form value PostgreSQL cannot take as text (invalid
// UTF-8, or a NUL byte), so that it is a bad request rather than a failed
// query.
func checkText(name, s string) error {
	switch {
	case !utf8.ValidString(s):
		return fmt.Errorf("%s %q is not valid UTF-8", name, truncate(s, 40))
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%s %q holds a NUL byte", name, truncate(s, 40))
	}
	return nil
}

// page is what every page's handler starts with: a context bounded by
// Config.QueryTimeout, the queries, and the database's clock (idem.clock(),
// which the pages' times are relative to). On an error it has answered.
type page struct {
	ctx context.Context
	q   *pgxdb.Queries
	now time.Time
}

func (d *Dashboard) page(w http.ResponseWriter, r *http.Request) (*page, context.CancelFunc, bool) {
	ctx, cancel := context.WithTimeout(r.Context(), d.cfg.QueryTimeout)
	q := pgxdb.New(d.cfg.Pool)
	now, err := q.DashClock(ctx)
	if err != nil {
		d.fail(w, r, "the clock", err)
		return nil, cancel, false
	}
	return &page{ctx: ctx, q: q, now: now.Time}, cancel, true
}

func formatInt(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

func formatPct(f float64) string {
	if math.IsNaN(f) {
		return "–"
	}
	switch {
	case f == 0:
		return "0%"
	case f < 0.001:
		return "<0.1%"
	}
	return strconv.FormatFloat(100*f, 'f', 1, 64) + "%"
}

func formatBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "–"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// formatAgo is t relative to now: "3m ago", "in 2h".
func formatAgo(now, t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	if d := now.Sub(t); d >= 0 {
		return formatDuration(d) + " ago"
	}
	return "in " + formatDuration(t.Sub(now))
}

func formatDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return fmt.Sprintf("%dms", d.Milliseconds())
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d >= 24*time.Hour && d%(24*time.Hour) == 0:
		return fmt.Sprintf("%dd", int(d.Hours()/24))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

// truncate shortens s to n runes, marking the cut; invalid UTF-8 is shown
// with replacement characters.
func truncate(s string, n int) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	r := []rune(s)
	return string(r[:n-1]) + "…"
}
