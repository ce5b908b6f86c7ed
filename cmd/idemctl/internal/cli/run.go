package cli

import (
	"context"
	"errors"
	"fmt"
	"github.com/spf13/cobra"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/robfig/cron/v3"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
)

func init() { register(newRunCmd) }

// cronParser accepts standard 5-field specs, an optional seconds field,
// descriptors (@every 5m, @daily) and a CRON_TZ=Zone/Name prefix.
var cronParser = cron.NewParser(cron.SecondOptional | cron.Minute | cron.Hour | cron.Dom | cron.Month | cron.Dow | cron.Descriptor)

// parseSpec parses a cron spec; a bad spec is an error, never a panic.
func parseSpec(flagName, spec string) (s cron.Schedule, err error) {
	defer func() {
		if p := recover(); p != nil {
			s, err = nil, usageErr("%s %q is not a valid cron spec: %v", flagName, spec, p)
		}
	}()
	s, err = cronParser.Parse(spec)
	if err != nil {
		return nil, usageErr("%s %q is not a valid cron spec: %v (examples: \"@every 5m\", \"@daily\", \"CRON_TZ=Europe/Paris 0 3 * * *\")", flagName, spec, err)
	}
	// The cron package runs "@every 0s", "@every -1s" and "@every 500ms"
	// every second: refused, as every other zero or negative duration is.
	if every, ok := s.(cron.ConstantDelaySchedule); ok {
		if d, perr := time.ParseDuration(everyArg(spec)); perr != nil || d < time.Second || every.Delay != d {
			return nil, usageErr("%s %q: an @every interval must be a whole number of seconds, at least 1s", flagName, spec)
		}
	}
	return s, nil
}

// everyArg is what follows "@every" in spec (after any CRON_TZ= prefix).
func everyArg(spec string) string {
	if i := strings.Index(spec, "@every"); i >= 0 {
		return strings.TrimSpace(spec[i+len("@every"):])
	}
	return ""
}

// testHook, when set by tests, sees the scheduler before it starts.
var testHook func(c *cron.Cron, m *metrics)

func newRunCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "run", Short: "daemon: prune, rotate and snapshot stats on cron schedules; /healthz, /metrics and (--http) the dashboard", Args: cobra.ArbitraryArgs,
		Example: `  idemctl run
  idemctl run --http --listen 127.0.0.1:9187
  idemctl run --http --listen 10.0.0.5:9187 --http-trusted-proxy 10.0.0.2 --http-host idem.example.com`}
	fs := cmd.Flags()
	pruneSpec := fs.String("prune-schedule", "@every 5m", "when to prune (cron spec; CRON_TZ= prefix for a time zone)")
	rotateSpec := fs.String("rotate-schedule", "@daily", "when to rotate partitions (cron spec)")
	statsSpec := fs.String("stats-schedule", "@every 5m", "when to snapshot per-source key counts for the dashboard (cron spec; a scan of processed_events)")
	listen := fs.String("listen", ":9187", "address for /healthz, /metrics and the dashboard (empty: no HTTP server); with --http and no --listen, 127.0.0.1:9187: the dashboard listens beyond loopback only when an address is given")
	serveDash := fs.Bool("http", false, "serve the dashboard at / on --listen (it has no authentication: listen on loopback or behind your proxy)")
	dashActions := fs.Bool("http-actions", false, "let the dashboard replay dead letters (default read-only)")
	dashResults := fs.Bool("http-results", false, "show stored results on the dashboard's keys page (they can hold personal data)")
	var dashHosts hostList
	fs.Var(&dashHosts, "http-host", "a host `name` the dashboard answers besides localhost, 127.0.0.1, ::1 and --listen's host, e.g. your proxy's when it forwards its own Host (repeat, or comma-separate; any other Host is refused with 421)")
	var trusted proxyList
	fs.Var(&trusted, "http-trusted-proxy", "the `address` (IP or CIDR) of the authenticating proxy in front of the dashboard, whose Remote-User header the audit log records (repeat, or comma-separate); from any other address the header is dropped")
	var tmo httpTimeouts
	fs.DurationVar(&tmo.read, "http-read-timeout", 30*time.Second, "how long the HTTP server waits for a request's headers and body")
	fs.DurationVar(&tmo.write, "http-write-timeout", time.Minute, "how long a response may take to write, from the end of the request's headers")
	fs.DurationVar(&tmo.idle, "http-idle-timeout", 2*time.Minute, "how long an idle keep-alive connection stays open")
	riverSchema := fs.String("river-schema", "", "the schema of River's tables, for the dashboard's dead letters (default: the search_path)")
	queue := fs.String("queue", inbox.DefaultQueue, "the inbox's River queue, for replays from the dashboard")
	shutdownWait := fs.Duration("shutdown-timeout", 30*time.Second, "on SIGTERM, how long to wait for a running job to stop")
	var pf pruneFlags
	pf.register(fs)
	var rf rotateFlags
	rf.register(fs, "rotate-")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if len(args) > 0 {
			return usageErr("run takes no arguments, got %q", args)
		}
		pf.cfg.LockTimeout, pf.cfg.StatementTimeout = g.timeouts()
		rf.cfg.LockTimeout, rf.cfg.StatementTimeout = g.timeouts()
		if err := pf.cfg.Validate(); err != nil {
			return configErr(err, pruneFlagNames)
		}
		if err := rf.cfg.Validate(); err != nil {
			return configErr(err, rotateFlagNames("rotate-"))
		}
		pruneSched, err := parseSpec("--prune-schedule", *pruneSpec)
		if err != nil {
			return err
		}
		rotateSched, err := parseSpec("--rotate-schedule", *rotateSpec)
		if err != nil {
			return err
		}
		statsSched, err := parseSpec("--stats-schedule", *statsSpec)
		if err != nil {
			return err
		}
		if (*serveDash || *dashActions || *dashResults || len(dashHosts) > 0) && *listen == "" {
			return usageErr("--http needs --listen (an address such as 127.0.0.1:9187)")
		}
		if (*dashActions || *dashResults || len(dashHosts) > 0 || len(trusted) > 0) && !*serveDash {
			return usageErr("--http-actions, --http-results, --http-host and --http-trusted-proxy need --http")
		}
		if *shutdownWait <= 0 {
			return usageErr("--shutdown-timeout %v must be positive (how long SIGTERM waits for a running job)", *shutdownWait)
		}
		if tmo.read <= 0 || tmo.write <= 0 || tmo.idle <= 0 {
			return usageErr("--http-read-timeout, --http-write-timeout and --http-idle-timeout must be positive (a server without them keeps a slow or idle client's connection forever)")
		}
		// The dashboard has no authentication: on loopback unless an
		// address is given.
		*listen = listenAddr(*listen, cmd.Flags().Changed("listen"), *serveDash)
		log, err := g.logger(io.Err)
		if err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 6)
		if err != nil {
			return err
		}
		defer pool.Close()
		// The rotation's flags against the database's bounds, before any job
		// is scheduled: out of range is a usage error now, not a failure at
		// every run.
		if err := partition.CheckConfig(ctx, pgxdb.New(pool), rf.cfg); err != nil {
			if errors.Is(err, partition.ErrInvalidConfig) {
				return configErr(err, rotateFlagNames("rotate-"))
			}
			return err
		}

		m := newMetrics(pool)
		pf.cfg.Logger = log.With(slog.String("job", "prune"))
		rf.cfg.Logger = log.With(slog.String("job", "rotate"))
		cl := cronLogger{log}
		// SkipIfStillRunning must wrap Recover, not the reverse: a panic that
		// escapes SkipIfStillRunning loses its token and the job never runs
		// again.
		c := cron.New(cron.WithParser(cronParser), cron.WithLogger(cl),
			cron.WithChain(cron.SkipIfStillRunning(cl), cron.Recover(cl)))
		pruneID := c.Schedule(pruneSched, m.job(ctx, log, "prune", m.pruneJob(pool, pf.cfg, log)))
		rotateID := c.Schedule(rotateSched, m.job(ctx, log, "rotate", func(ctx context.Context) (string, error) {
			res, err := partition.Rotate(ctx, pool, rf.cfg)
			if err != nil {
				return "error", err
			}
			if res.Skipped {
				return "skipped", nil
			}
			return "ok", nil
		}))
		statsID := c.Schedule(statsSched, m.job(ctx, log, "snapshot", snapshotJob(pool, log)))
		// Each job's last success exists from the start (the daemon's start
		// time until a run succeeds): "no successful prune for two hours" then
		// fires even when no run ever succeeds, or none ever ends.
		for _, job := range []string{"prune", "rotate", "snapshot"} {
			m.lastOK.WithLabelValues(job).SetToCurrentTime()
		}
		if testHook != nil {
			testHook(c, m)
		}

		var srv *http.Server
		if *listen != "" {
			var dash http.Handler
			hosts := dashboardHosts(*listen, dashHosts)
			if *serveDash {
				next := func() time.Time { return c.Entry(statsID).Next }
				if dash, err = newDashboard(ctx, pool, log, *riverSchema, *queue, *dashActions, *dashResults, hosts, next); err != nil {
					return err
				}
			}
			ln, err := net.Listen("tcp", *listen)
			if err != nil {
				return usageErr("--listen %s: %v", *listen, err)
			}
			if dash != nil {
				dash = trustProxies(dash, trusted)
			}
			srv = tmo.server(m.handler(pool, log, dash))
			go func() { _ = srv.Serve(ln) }()
			what := "/healthz and /metrics"
			if dash != nil {
				what += " and the dashboard at /"
				if host, _, _ := net.SplitHostPort(ln.Addr().String()); !isLoopback(host) {
					log.LogAttrs(ctx, slog.LevelWarn, "the dashboard has no authentication and listens beyond this machine: put it behind your authenticating proxy, or --listen 127.0.0.1:PORT",
						slog.String("addr", ln.Addr().String()))
				}
			}
			attrs := []slog.Attr{slog.String("addr", ln.Addr().String())}
			if dash != nil {
				attrs = append(attrs, slog.String("dashboard_hosts", strings.Join(hosts, ",")))
			}
			log.LogAttrs(ctx, slog.LevelInfo, "serving "+what, attrs...)
		}
		c.Start()
		log.LogAttrs(ctx, slog.LevelInfo, "idemctl run started",
			slog.String("prune_schedule", *pruneSpec), slog.String("rotate_schedule", *rotateSpec),
			slog.String("stats_schedule", *statsSpec))
		// Once at start, rotation then prune, through the same chain (a run of
		// the schedule that comes meanwhile is skipped, not doubled): a daemon
		// restarted after a long stop, or with a daily rotation, does not wait
		// for its first tick.
		// They run outside cron's runner, so shutdown waits for them as it
		// does for cron's: the job in flight finishes its step, releases its
		// lock and records its run; the ones after it do not start.
		startup := make(chan struct{})
		go func() {
			defer close(startup)
			for _, id := range []cron.EntryID{rotateID, pruneID, statsID} {
				if ctx.Err() != nil {
					return
				}
				c.Entry(id).WrappedJob.Run()
			}
		}()

		<-ctx.Done()
		log.LogAttrs(context.Background(), slog.LevelInfo, "shutting down: waiting for running jobs")
		stopped := c.Stop() // running jobs see ctx cancelled: prune stops after its current batch, rotate after its current step
		deadline, cancelWait := context.WithTimeout(context.Background(), *shutdownWait)
		defer cancelWait()
		for _, done := range []<-chan struct{}{stopped.Done(), startup} {
			select {
			case <-done:
			case <-deadline.Done():
			}
		}
		if deadline.Err() != nil {
			log.LogAttrs(context.Background(), slog.LevelWarn, "a job did not stop in time; exiting anyway (its transaction is rolled back by the server)")
		}
		if srv != nil {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}
		log.LogAttrs(context.Background(), slog.LevelInfo, "idemctl run stopped")
		return nil
	}
	return cmd
}

// stuckGrace is how long ago a processing key's lease must have ended for
// idem_stuck_leases to count it (idemctl check's default --stuck-grace).
const stuckGrace = 10 * time.Minute

// pruneJob is the body of the daemon's prune job: a prune run, then the
// count of stuck leases (a scan of the processing rows, so it is taken once
// per prune run rather than at every scrape).
func (m *metrics) pruneJob(pool *pgxpool.Pool, cfg prune.Config, log *slog.Logger) func(context.Context) (string, error) {
	return func(ctx context.Context) (string, error) {
		res, err := prune.Run(ctx, pool, cfg)
		if err != nil {
			return "error", err
		}
		m.deleted.Add(float64(res.Deleted))
		if stuck, err := pgxdb.New(pool).StuckLeases(ctx, stuckGrace.Milliseconds()); err == nil {
			m.stuck.Set(float64(stuck))
		} else {
			log.LogAttrs(ctx, slog.LevelWarn, "could not count stuck leases", slog.Any("error", err))
		}
		if res.Skipped {
			return "skipped", nil
		}
		log.LogAttrs(ctx, slog.LevelInfo, "prune done", slog.Int64("deleted", res.Deleted),
			slog.Int("batches", res.Batches), slog.String("stopped", res.Stopped))
		return "ok", nil
	}
}

// metrics are the daemon's Prometheus metrics, on a registry of its own.
type metrics struct {
	reg      *prometheus.Registry
	runs     *prometheus.CounterVec
	duration *prometheus.HistogramVec
	lastOK   *prometheus.GaugeVec
	deleted  prometheus.Counter
	stuck    prometheus.Gauge
}

func newMetrics(pool *pgxpool.Pool) *metrics {
	m := &metrics{
		reg: prometheus.NewRegistry(),
		runs: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "idem_job_runs_total",
			Help: "Runs of the daemon's jobs by result (ok, skipped, error, panic)."}, []string{"job", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "idem_job_duration_seconds",
			Help: "How long each job run took.", Buckets: prometheus.ExponentialBuckets(0.01, 4, 10)}, []string{"job"}),
		lastOK: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "idem_job_last_success_timestamp_seconds",
			Help: "Unix time of the last successful run of each job (the daemon's start until one succeeds)."}, []string{"job"}),
		deleted: prometheus.NewCounter(prometheus.CounterOpts{Name: "idem_prune_rows_deleted_total",
			Help: "Expired rows deleted by prune."}),
		stuck: prometheus.NewGauge(prometheus.GaugeOpts{Name: "idem_stuck_leases",
			Help: "Keys still processing whose lease ended more than 10 minutes ago and that nobody re-acquired; counted after each prune run."}),
	}
	m.reg.MustRegister(m.runs, m.duration, m.lastOK, m.deleted, m.stuck, &dbCollector{pool: pool},
		prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	return m
}

// job wraps a job body with metrics. A panic is counted, then re-raised for
// cron.Recover to log, so the daemon survives it.
func (m *metrics) job(ctx context.Context, log *slog.Logger, name string, body func(context.Context) (string, error)) cron.Job {
	return cron.FuncJob(func() {
		if ctx.Err() != nil {
			return
		}
		start := time.Now()
		defer func() {
			if p := recover(); p != nil {
				m.runs.WithLabelValues(name, "panic").Inc()
				panic(p)
			}
		}()
		result, err := body(ctx)
		m.duration.WithLabelValues(name).Observe(time.Since(start).Seconds())
		m.runs.WithLabelValues(name, result).Inc()
		if err != nil {
			log.LogAttrs(ctx, slog.LevelError, "job failed", slog.String("job", name), slog.Any("error", err))
			return
		}
		m.lastOK.WithLabelValues(name).SetToCurrentTime()
	})
}

// handler serves /metrics, /healthz (readiness: the database answers),
// /livez (liveness: the process serves; a database outage is not a reason
// to restart it) and the dashboard (when not nil) at every other path.
func (m *metrics) handler(pool *pgxpool.Pool, log *slog.Logger, dash http.Handler) http.Handler {
	mux := http.NewServeMux()
	if dash != nil {
		mux.Handle("/", dash)
	}
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/livez", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := pool.Ping(ctx); err != nil {
			// The probe's answer says nothing of the connection (host,
			// port, user, database): whoever can reach /healthz is not
			// necessarily allowed to know them. The log has the reason.
			log.LogAttrs(ctx, slog.LevelWarn, "healthz: database unreachable", slog.String("error", redact(err.Error())))
			http.Error(w, "database unreachable", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// dbCollector reads partition health at scrape time.
type dbCollector struct{ pool *pgxpool.Pool }

var (
	descAhead = prometheus.NewDesc("idem_partitions_ahead",
		"Consecutive months after the current one that have a partition.", nil, nil)
	descDefault = prometheus.NewDesc("idem_default_partition_rows",
		"Rows in the default partition (claims for months without a partition), counted up to 100,001.", nil, nil)
	descUp = prometheus.NewDesc("idem_database_up", "1 when the last scrape could query the database.", nil, nil)
)

func (d *dbCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descAhead
	ch <- descDefault
	ch <- descUp
}

func (d *dbCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	// Only the cheap facts: check's expired and stuck counts scan the table.
	q := pgxdb.New(d.pool)
	_, ahead, err := monthsAhead(ctx, q)
	if err != nil {
		ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, 0)
		return
	}
	ch <- prometheus.MustNewConstMetric(descUp, prometheus.GaugeValue, 1)
	ch <- prometheus.MustNewConstMetric(descAhead, prometheus.GaugeValue, float64(ahead))
	// Counted up to a bound, so that the scrape reads the same few rows at
	// most however many there are: the alert asks whether there are any,
	// and a full count of tens of millions would outlast the scrape (and,
	// before, read as the database being down).
	if inDefault, err := q.DefaultPartitionRowsUpTo(ctx, defaultRowsCap); err == nil {
		ch <- prometheus.MustNewConstMetric(descDefault, prometheus.GaugeValue, float64(inDefault))
	}
}

// defaultRowsCap bounds the scrape's count of the default partition's
// rows: idem_default_partition_rows reads at most defaultRowsCap + 1.
var defaultRowsCap int64 = 100_000

// cronLogger adapts slog to cron.Logger.
type cronLogger struct{ l *slog.Logger }

func (c cronLogger) Info(msg string, kv ...any) { c.l.Debug("cron: "+msg, kv...) }
func (c cronLogger) Error(err error, msg string, kv ...any) {
	c.l.Error("cron: "+msg, append(kv, "error", err)...)
}

// httpTimeouts are the daemon's HTTP server's timeouts (--http-*-timeout):
// a client that sends slowly, reads slowly or keeps a connection idle
// holds it only that long.
type httpTimeouts struct{ read, write, idle time.Duration }

func (t httpTimeouts) server(h http.Handler) *http.Server {
	return &http.Server{Handler: h, ReadHeaderTimeout: min(5*time.Second, t.read), ReadTimeout: t.read,
		WriteTimeout: t.write, IdleTimeout: t.idle}
}

// listenAddr is the daemon's listening address: --listen when given; with
// --http and no --listen, loopback (the dashboard has no authentication,
// so it is reachable from other machines only when an address says so);
// otherwise --listen's default, every interface, for /healthz and /metrics.
func listenAddr(listen string, given, dashboard bool) string {
	if dashboard && !given {
		return "127.0.0.1:9187"
	}
	return listen
}
