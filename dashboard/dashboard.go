// Package dashboard is idem's operator page as an http.Handler: per source
// claims per minute and duplicate rates (a sortable summary, and charts
// drawn as SVG on the server), in-flight and stuck leases, failed keys,
// the inbox's jobs by state and dead letters with bulk replay, one event's
// timeline, partitions and the last maintenance runs. The overview, jobs
// and timeline refresh themselves while their tab is visible (one small
// script of its own; plain pages without it). At most Config.MaxPages
// pages are served at once; the others are answered 503 before any query.
//
// Mount it under a prefix of your own server, behind your own
// authentication (it has none):
//
//	h, err := dashboard.New(dashboard.Config{Pool: pool, Prefix: "/idem"})
//	mux.Handle("/idem/", requireOperator(h))
//
// or run it with idemctl run --http. It is read-only unless Config.Actions
// is set; actions (replaying dead letters) are protected against
// cross-site requests (http.CrossOriginProtection) and logged;
// Config.AllowedHosts refuses requests for other host names (DNS
// rebinding). It shows no stored result unless Config.ShowResults is set,
// and never a payload.
//
// Every page reads an index, a small table or the catalog (migration 10's
// idem.activity, idem.source_snapshots, idem.runs): never a scan of
// processed_events, so a page answers in milliseconds at any table size.
// The counts that need a scan (keys by status, stuck leases) come from the
// last snapshot (idem.snapshot_stats(), taken by idemctl run on its
// --stats-schedule) and say when it was taken. See docs/dashboard.md.
package dashboard

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/inbox"
)

// Defaults of Config.
const (
	DefaultDuplicateAlert = 0.2
	DefaultQueryTimeout   = 5 * time.Second
	// DefaultReplayLimit is the most dead letters one replay goes through.
	DefaultReplayLimit = 10000
	// DefaultMaxPages is how many pages are served at once (Config.MaxPages).
	DefaultMaxPages = 4
)

// ErrInvalidConfig is matched by New's errors.
var ErrInvalidConfig = errors.New("dashboard: invalid config")

// Config configures the dashboard. Only Pool is required.
type Config struct {
	// Pool is the database, with the rights of a role given
	// idem.grant_maintainer (reads idem's tables; replays dead letters).
	Pool *pgxpool.Pool
	// Inbox, when the application uses package inbox, gives the dead
	// letters page and its replay; nil: the page says the inbox is not in
	// use. Its Pool should be Pool.
	Inbox *inbox.Inbox
	// Prefix is the path the handler is mounted under ("/idem"; default
	// "": the root). Links and forms carry it; requests outside it are 404.
	Prefix string
	// Actions turns on replaying dead letters (default false: read-only,
	// and no action route exists).
	Actions bool
	// ShowResults shows a key's stored result on the keys page (default
	// false: results can hold personal data; only their size is shown).
	ShowResults bool
	// DuplicateAlert is the duplicate rate drawn as the alert threshold in
	// the charts and flagged in the overview, in (0, 1] (0: the default,
	// DefaultDuplicateAlert, as docs/alerts.yml's IdemDuplicateRateSpike).
	DuplicateAlert float64
	// NextSnapshot, when set, tells when the next per-source snapshot of
	// key counts will be taken (idemctl run passes its --stats-schedule's
	// next run): a source that has none yet says when one will come.
	// Nil: the page says which command takes them.
	NextSnapshot func() time.Time
	// QueryTimeout bounds each page's queries (0: DefaultQueryTimeout).
	QueryTimeout time.Duration
	// ReplayLimit is the most dead letters one replay goes through (0:
	// DefaultReplayLimit).
	ReplayLimit int
	// AllowedHosts are the host names and IP addresses (without a port)
	// the handler answers: a request whose Host header, its port ignored
	// and compared case-insensitively, is none of them is answered 421
	// Misdirected Request and nothing runs. Default nil (or empty): any
	// host. A browser takes a page of another name that resolves to the
	// dashboard's address (DNS rebinding) for the dashboard's own origin,
	// so the cross-origin protection of actions lets its forms and reads
	// through; on a listener without authentication, a loopback one
	// included (any web page the operator opens can rebind a name to
	// 127.0.0.1), set the names the dashboard is reached by. Mounted
	// behind the application's own server and authentication it is
	// normally left empty: the rebound page does not have the operator's
	// credentials, which the browser keeps for the real name.
	AllowedHosts []string
	// MaxPages bounds the pages served at once (0: DefaultMaxPages): a
	// page asked for while that many are being served is answered 503 with
	// Retry-After at once, without a query, so that a storm of page loads
	// never holds more than MaxPages of Pool's connections. Give the
	// dashboard a pool of its own (or MaxPages below the pool's size) so
	// that the process's probes and jobs never wait behind pages.
	MaxPages int
	// Logger logs every action (who asked is the request's remote address
	// and, when set by your middleware, its Remote-User header), every
	// cross-origin action and request for a host not allowed that it
	// refuses, and every failed query (default: slog.Default()).
	Logger *slog.Logger
}

// Dashboard is the handler New returns.
type Dashboard struct {
	cfg   Config
	log   *slog.Logger
	root  http.Handler
	hosts map[string]bool // Config.AllowedHosts, normalized; nil: any
	pages chan struct{}   // a slot per page served at once (Config.MaxPages)
}

// New validates cfg and returns the dashboard.
func New(cfg Config) (*Dashboard, error) {
	bad := func(field, format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, a...))
	}
	switch {
	case cfg.Pool == nil:
		return nil, bad("Pool", "is required")
	case cfg.DuplicateAlert < 0 || cfg.DuplicateAlert > 1:
		return nil, bad("DuplicateAlert", "%g is not a rate in (0, 1]", cfg.DuplicateAlert)
	case cfg.QueryTimeout < 0:
		return nil, bad("QueryTimeout", "%s is negative", cfg.QueryTimeout)
	case cfg.ReplayLimit < 0:
		return nil, bad("ReplayLimit", "%d is negative", cfg.ReplayLimit)
	case cfg.MaxPages < 0:
		return nil, bad("MaxPages", "%d is negative", cfg.MaxPages)
	}
	if cfg.Prefix != "" && (!strings.HasPrefix(cfg.Prefix, "/") || strings.HasSuffix(cfg.Prefix, "/") || strings.ContainsAny(cfg.Prefix, "?#{}")) {
		return nil, bad("Prefix", "%q must start with / and not end with one (e.g. \"/idem\")", cfg.Prefix)
	}
	var hosts map[string]bool
	for _, h := range cfg.AllowedHosts {
		n, ok := normalizeHost(h)
		if !ok {
			return nil, bad("AllowedHosts", "%q is not a host name or an IP address (without a port)", h)
		}
		if hosts == nil {
			hosts = map[string]bool{}
		}
		hosts[n] = true
	}
	if cfg.DuplicateAlert == 0 {
		cfg.DuplicateAlert = DefaultDuplicateAlert
	}
	cfg.QueryTimeout = cmp.Or(cfg.QueryTimeout, DefaultQueryTimeout)
	cfg.ReplayLimit = cmp.Or(cfg.ReplayLimit, DefaultReplayLimit)
	cfg.MaxPages = cmp.Or(cfg.MaxPages, DefaultMaxPages)
	d := &Dashboard{cfg: cfg, log: cmp.Or(cfg.Logger, slog.Default()), hosts: hosts, pages: make(chan struct{}, cfg.MaxPages)}

	mux := http.NewServeMux()
	mux.HandleFunc("GET /{$}", d.overview)
	mux.HandleFunc("GET /keys", d.keys)
	mux.HandleFunc("GET /dead", d.deadLetters)
	mux.HandleFunc("GET /maintenance", d.maintenance)
	mux.HandleFunc("GET /jobs", d.jobs)
	mux.HandleFunc("GET /timeline", d.timeline)
	mux.Handle("GET /static/", http.FileServerFS(staticFS))
	// Browsers ask for /favicon.ico on pages without a link (a plain-text
	// error); at the root, answer it rather than log a 404.
	mux.HandleFunc("GET /favicon.ico", func(w http.ResponseWriter, r *http.Request) {
		http.ServeFileFS(w, r, staticFS, "static/favicon.svg")
	})
	if cfg.Actions {
		// Only with actions on does an action route exist; every one is
		// refused when the browser says it comes from another origin.
		cop := http.NewCrossOriginProtection()
		cop.SetDenyHandler(http.HandlerFunc(d.crossOrigin))
		mux.Handle("POST /dead/replay", cop.Handler(http.HandlerFunc(d.replay)))
	}
	d.root = mux
	if cfg.Prefix != "" {
		d.root = http.StripPrefix(cfg.Prefix, mux)
	}
	return d, nil
}

// ServeHTTP serves the dashboard's pages under Config.Prefix.
func (d *Dashboard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.Header().Set("Referrer-Policy", "same-origin")
	// No script but the dashboard's own (static/live.js: the live
	// refresh), no frame.
	w.Header().Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; frame-ancestors 'none'; form-action 'self'")
	if d.hosts != nil && !d.hostAllowed(r.Host) {
		d.misdirected(w, r)
		return
	}
	if d.cfg.Prefix != "" && r.URL.Path == d.cfg.Prefix {
		http.Redirect(w, r, d.cfg.Prefix+"/", http.StatusMovedPermanently)
		return
	}
	if !strings.HasPrefix(r.URL.Path, d.cfg.Prefix+"/static/") {
		select {
		case d.pages <- struct{}{}:
			defer func() { <-d.pages }()
		default:
			d.busy(w, r)
			return
		}
	}
	d.root.ServeHTTP(w, r)
}

// busy answers a page asked for while Config.MaxPages are being served:
// shed at once, before any query, so that pages never queue for the
// database's connections.
func (d *Dashboard) busy(w http.ResponseWriter, r *http.Request) {
	d.log.LogAttrs(r.Context(), slog.LevelWarn, "dashboard: busy, page shed",
		slog.String("path", r.URL.Path), slog.String("remote", r.RemoteAddr), slog.Int("max_pages", d.cfg.MaxPages))
	w.Header().Set("Retry-After", "1")
	http.Error(w, "the dashboard is busy: too many pages at once (Config.MaxPages); try again", http.StatusServiceUnavailable)
}

// crossOrigin answers an action request that came from another origin.
func (d *Dashboard) crossOrigin(w http.ResponseWriter, r *http.Request) {
	d.log.LogAttrs(r.Context(), slog.LevelWarn, "dashboard: cross-origin action refused",
		slog.String("path", r.URL.Path), slog.String("origin", r.Header.Get("Origin")),
		slog.String("sec_fetch_site", r.Header.Get("Sec-Fetch-Site")), slog.String("remote", r.RemoteAddr))
	http.Error(w, "cross-origin request refused: actions are taken from the dashboard's own pages", http.StatusForbidden)
}

// normalizeHost is a host name (lower case) or an IP address (in its
// canonical form); ok is false for anything else (a port, a path, an
// empty name).
func normalizeHost(h string) (string, bool) {
	if a, err := netip.ParseAddr(strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")); err == nil && a.Zone() == "" {
		return a.Unmap().String(), true
	}
	if h == "" || len(h) > 253 {
		return "", false
	}
	for _, c := range h {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '.' || c == '_') {
			return "", false
		}
	}
	return strings.ToLower(h), true
}

// hostAllowed tells whether a request's Host header names one of
// Config.AllowedHosts (its port ignored).
func (d *Dashboard) hostAllowed(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	n, ok := normalizeHost(host)
	return ok && d.hosts[n]
}

// misdirected answers a request for a host the dashboard does not answer.
func (d *Dashboard) misdirected(w http.ResponseWriter, r *http.Request) {
	d.log.LogAttrs(r.Context(), slog.LevelWarn, "dashboard: request for a host not allowed refused",
		slog.String("host", truncate(r.Host, 80)), slog.String("path", r.URL.Path), slog.String("remote", r.RemoteAddr))
	http.Error(w, "misdirected request: this host name is not one of the dashboard's AllowedHosts (idemctl run: --http-host)", http.StatusMisdirectedRequest)
}
