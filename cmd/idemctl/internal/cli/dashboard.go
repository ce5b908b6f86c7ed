package cli

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/maintlock"
)

// dashboardConns is the size of idemctl run --http's dashboard's own pool,
// and the pages it serves at once (dashboard.Config.MaxPages): the
// daemon's pool stays for /healthz, /metrics and the scheduled jobs, which
// never wait behind pages; a page past these is answered 503.
const dashboardConns = 4

// newDashboard is idemctl run --http's dashboard, on a pool of its own
// (dashboardConns connections, with the daemon pool's settings) closed
// when ctx is done. The dead letters page and its replay need the inbox's
// River tables; without them the page says the inbox is not in use.
func newDashboard(ctx context.Context, daemonPool *pgxpool.Pool, log *slog.Logger, riverSchema, queue string, actions, results bool, hosts []string, nextSnapshot func() time.Time) (http.Handler, error) {
	pcfg := daemonPool.Config().Copy()
	pcfg.MaxConns, pcfg.MinConns = dashboardConns, 0
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, err
	}
	context.AfterFunc(ctx, pool.Close)
	table := "river_job"
	if riverSchema != "" {
		table = pgx.Identifier{riverSchema, "river_job"}.Sanitize()
	}
	var hasRiver bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&hasRiver); err != nil {
		pool.Close()
		return nil, err
	}
	cfg := dashboard.Config{Pool: pool, Actions: actions, ShowResults: results, AllowedHosts: hosts, MaxPages: dashboardConns, NextSnapshot: nextSnapshot,
		Logger: log.With(slog.String("component", "dashboard"))}
	if hasRiver {
		in, err := inbox.New(inbox.Config{Pool: pool, Schema: riverSchema, Queue: queue, Logger: log})
		if err != nil {
			pool.Close()
			return nil, usageErr("%v", err)
		}
		cfg.Inbox = in
	}
	d, err := dashboard.New(cfg)
	if err != nil {
		pool.Close()
		return nil, usageErr("%v", err)
	}
	return d, nil
}

// dashboardHosts are the host names idemctl run's dashboard answers
// (dashboard.Config.AllowedHosts): the loopback names, --listen's host
// when it names one address (not every interface), and --http-host's.
// Any other Host is refused, so that a page on another name resolving to
// the listener's address (DNS rebinding) cannot use the dashboard.
func dashboardHosts(listen string, extra []string) []string {
	hosts := []string{"localhost", "127.0.0.1", "::1"}
	if h, _, err := net.SplitHostPort(listen); err == nil && h != "" && h != "0.0.0.0" && h != "::" && !slices.Contains(hosts, h) {
		hosts = append(hosts, h)
	}
	for _, h := range extra {
		if !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	return hosts
}

// hostList is --http-host: repeated, or comma-separated.
type hostList []string

func (l *hostList) String() string { return strings.Join(*l, ",") }

// Type names the value in help (pflag.Value).
func (l *hostList) Type() string { return "names" }

func (l *hostList) Set(s string) error {
	for _, h := range strings.Split(s, ",") {
		h = strings.ToLower(strings.TrimSpace(h))
		if h == "" {
			return fmt.Errorf("empty host name in %q", s)
		}
		notName := func(c rune) bool { return !strings.ContainsRune("abcdefghijklmnopqrstuvwxyz0123456789-._", c) }
		if _, err := netip.ParseAddr(h); err != nil && strings.ContainsFunc(h, notName) {
			return fmt.Errorf("%q is not a host name or an IP address: give the name alone, without a scheme or a port", h)
		}
		*l = append(*l, h)
	}
	return nil
}

// snapshotJob is the daemon's snapshot job: idem.snapshot_stats(), the
// per-source counts the dashboard's overview shows, recorded in idem.runs.
func snapshotJob(pool *pgxpool.Pool, log *slog.Logger) func(context.Context) (string, error) {
	holder := maintlock.NewHolderID()
	return func(ctx context.Context) (string, error) {
		start := time.Now()
		q := pgxdb.New(pool)
		n, err := q.SnapshotStats(ctx)
		r := maintlock.Run{Job: "snapshot", Started: start, Outcome: "ok", Holder: holder,
			Figures: map[string]any{"sources": n}}
		if err != nil {
			r.Outcome, r.Err, r.Figures = "error", err, nil
		}
		maintlock.Record(ctx, q, log, r)
		if err != nil {
			return "error", err
		}
		return "ok", nil
	}
}

// isLoopback: an address only this machine reaches ("" is every interface).
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// proxyList is --http-trusted-proxy: IP addresses or CIDR prefixes,
// repeated or comma-separated.
type proxyList []netip.Prefix

func (l *proxyList) String() string {
	var out []string
	for _, p := range *l {
		out = append(out, p.String())
	}
	return strings.Join(out, ",")
}

// Type names the value in help (pflag.Value).
func (l *proxyList) Type() string { return "addresses" }

func (l *proxyList) Set(s string) error {
	for _, a := range strings.Split(s, ",") {
		a = strings.TrimSpace(a)
		if p, err := netip.ParsePrefix(a); err == nil {
			*l = append(*l, p.Masked())
			continue
		}
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return fmt.Errorf("%q is not an IP address or a CIDR prefix (10.0.0.2, 10.0.0.0/8, ::1)", a)
		}
		*l = append(*l, netip.PrefixFrom(ip.Unmap(), ip.Unmap().BitLen()))
	}
	return nil
}

// trustProxies keeps a request's Remote-User header, which the dashboard's
// audit log records as who asked, only when the request comes from one of
// the trusted proxies' addresses; from anywhere else the header is dropped,
// so that a client reaching the listener directly cannot name someone else.
func trustProxies(next http.Handler, trusted proxyList) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, ok := r.Header["Remote-User"]; ok && !fromTrusted(r.RemoteAddr, trusted) {
			r = r.Clone(r.Context())
			r.Header.Del("Remote-User")
		}
		next.ServeHTTP(w, r)
	})
}

func fromTrusted(remote string, trusted proxyList) bool {
	ap, err := netip.ParseAddrPort(remote)
	if err != nil {
		return false
	}
	ip := ap.Addr().Unmap()
	for _, p := range trusted {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}
