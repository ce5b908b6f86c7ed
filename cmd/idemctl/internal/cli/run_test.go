package cli

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/robfig/cron/v3"

	"github.com/idemkit/idem/internal/testdb"
)

func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestRunDaemon: with @every 1s schedules the daemon runs its jobs, never
// overlaps a job with itself, survives a panicking job, serves /healthz and
// /metrics, and returns 0 when its context ends (SIGTERM in main).
func TestRunDaemon(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	seedRows(t, pool, "exp-", monthStart(time.Now(), 0), 300, true, false)
	addr := freeAddr(t)

	var running, maxRunning, slowRuns, panics atomic.Int64
	testHook = func(c *cron.Cron, m *metrics) {
		// A job that takes 2.5s on a 1s schedule: SkipIfStillRunning must
		// keep it from overlapping itself.
		c.Schedule(cron.Every(time.Second), m.job(ctx, nil, "slow", func(context.Context) (string, error) {
			n := running.Add(1)
			for {
				old := maxRunning.Load()
				if n <= old || maxRunning.CompareAndSwap(old, n) {
					break
				}
			}
			time.Sleep(2500 * time.Millisecond)
			running.Add(-1)
			slowRuns.Add(1)
			return "ok", nil
		}))
		c.Schedule(cron.Every(time.Second), m.job(ctx, nil, "boom", func(context.Context) (string, error) {
			panics.Add(1)
			panic("job exploded")
		}))
	}
	defer func() { testHook = nil }()

	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr,
			"--prune-schedule", "@every 1s", "--rotate-schedule", "@every 1s", "--sleep", "1ms"},
			&out, &errw, func(string) string { return "" })
	}()
	// Let it run for a few seconds.
	deadline := time.Now().Add(20 * time.Second)
	for slowRuns.Load() < 2 || panics.Load() < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("jobs did not run: slow=%d panics=%d\n%s", slowRuns.Load(), panics.Load(), errw.String())
		}
		select {
		case c := <-code:
			t.Fatalf("daemon exited early with %d: %s", c, errw.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
	if maxRunning.Load() != 1 {
		t.Errorf("the slow job overlapped itself: %d at once", maxRunning.Load())
	}
	status, body := get(t, "http://"+addr+"/healthz")
	if status != 200 || strings.TrimSpace(body) != "ok" {
		t.Errorf("/healthz: %d %q", status, body)
	}
	_, metrics := get(t, "http://"+addr+"/metrics")
	for _, want := range []string{
		`idem_job_runs_total{job="prune",result="ok"}`,
		`idem_job_runs_total{job="rotate",result="ok"}`,
		`idem_job_runs_total{job="boom",result="panic"}`,
		`idem_prune_rows_deleted_total 300`,
		`idem_partitions_ahead 3`,
		`idem_default_partition_rows 0`,
		`idem_job_last_success_timestamp_seconds{job="prune"}`,
		`idem_job_duration_seconds_bucket{job="rotate"`,
		`idem_database_up 1`,
	} {
		if !strings.Contains(metrics, want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	if !strings.Contains(errw.String(), "job exploded") {
		t.Errorf("the panic was not logged:\n%s", errw.String())
	}
	cancel()
	select {
	case c := <-code:
		if c != 0 {
			t.Fatalf("exit %d after shutdown: %s", c, errw.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("daemon did not stop within 10s of its context ending")
	}
}

// TestRunSIGTERM: the real binary exits 0 on SIGTERM.
func TestRunSIGTERM(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	addr := freeAddr(t)
	cmd := exec.Command(binary(t), "run", "--database-url", url, "--listen", addr, "--prune-schedule", "@every 1s")
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			t.Fatalf("daemon never served /healthz: %v\n%s", err, out.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	time.Sleep(1500 * time.Millisecond) // let a prune run happen
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "idemctl run stopped") {
		t.Fatalf("no clean shutdown in the log:\n%s", out.String())
	}
}

// TestRunOnceAtStart: with schedules that do not come due during the test,
// the daemon still rotates and prunes once as it starts.
func TestRunOnceAtStart(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	seedRows(t, pool, "exp-", monthStart(time.Now(), 0), 50, true, false)
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr,
			"--prune-schedule", "@monthly", "--rotate-schedule", "@monthly", "--sleep", "1ms"},
			&out, &errw, func(string) string { return "" })
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var metrics string
		if resp, err := http.Get("http://" + addr + "/metrics"); err == nil { // not listening yet: try again
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			metrics = string(b)
		}
		if strings.Contains(metrics, `idem_job_runs_total{job="prune",result="ok"} 1`) &&
			strings.Contains(metrics, `idem_job_runs_total{job="rotate",result="ok"} 1`) &&
			strings.Contains(metrics, `idem_prune_rows_deleted_total 50`) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no rotation and prune at start:\n%s\n%s", metrics, errw.String())
		}
		select {
		case c := <-code:
			t.Fatalf("daemon exited early with %d: %s", c, errw.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
	cancel()
	if c := <-code; c != 0 {
		t.Fatalf("exit %d after shutdown: %s", c, errw.String())
	}
}

// TestHealthzRevealsNothing: with the database down, /healthz answers 503
// without the host, port, user or database name (the log has the reason).
func TestHealthzRevealsNothing(t *testing.T) {
	t.Parallel()
	addr := freeAddr(t) // nothing listens there once freeAddr returns
	host, port, _ := strings.Cut(addr, ":")
	pool, err := pgxpool.New(context.Background(), "postgres://secretuser:secretpw@"+addr+"/secretdb?connect_timeout=1")
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var logs testdb.Buffer
	srv := httptest.NewServer(newMetrics(pool).handler(pool, slog.New(slog.NewTextHandler(&logs, nil)), nil))
	defer srv.Close()
	status, body := get(t, srv.URL+"/healthz")
	if status != http.StatusServiceUnavailable || strings.TrimSpace(body) != "database unreachable" {
		t.Fatalf("/healthz: %d %q", status, body)
	}
	for _, secret := range []string{"secretuser", "secretpw", "secretdb", host, port} {
		if strings.Contains(body, secret) {
			t.Fatalf("/healthz reveals %q: %q", secret, body)
		}
	}
	if !strings.Contains(logs.String(), "healthz: database unreachable") || strings.Contains(logs.String(), "secretpw") {
		t.Fatalf("the log should have the reason, without the password:\n%s", logs.String())
	}
}

// TestRunDashboardHosts: idemctl run --http answers the loopback names,
// --listen's host and --http-host's (repeated or comma-separated), and
// refuses any other Host with 421 (a DNS-rebinding page); /healthz is not
// the dashboard's and answers any Host. The flag is listed by --help and
// checked as it is parsed.
func TestRunDashboardHosts(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	t.Run("default hosts", func(t *testing.T) {
		for listen, want := range map[string]string{
			":9187":            "localhost,127.0.0.1,::1",
			"0.0.0.0:9187":     "localhost,127.0.0.1,::1",
			"[::]:9187":        "localhost,127.0.0.1,::1",
			"127.0.0.1:9187":   "localhost,127.0.0.1,::1",
			"[::1]:9187":       "localhost,127.0.0.1,::1",
			"10.1.2.3:9187":    "localhost,127.0.0.1,::1,10.1.2.3",
			"ops.internal:80":  "localhost,127.0.0.1,::1,ops.internal",
			"[fd00::5]:9187":   "localhost,127.0.0.1,::1,fd00::5",
			"localhost:9187":   "localhost,127.0.0.1,::1",
			"no-port-is-wrong": "localhost,127.0.0.1,::1",
		} {
			if got := strings.Join(dashboardHosts(listen, nil), ","); got != want {
				t.Errorf("--listen %s: %s, want %s", listen, got, want)
			}
		}
		if got := strings.Join(dashboardHosts(":9187", []string{"proxy.example", "localhost"}), ","); got != "localhost,127.0.0.1,::1,proxy.example" {
			t.Errorf("with --http-host: %s", got)
		}
	})
	t.Run("usage", func(t *testing.T) {
		if r := idemctl(t, ctx, nil, "run", "--help"); r.code != 0 || !strings.Contains(r.out+r.errout, "-http-host name") {
			t.Errorf("run --help does not list --http-host: %+v", r)
		}
		for _, args := range [][]string{
			{"run", "--http-host", "dash.example"},
			{"run", "--http", "--http-host", "dash.example:9187"},
			{"run", "--http", "--http-host", "http://dash.example"},
			{"run", "--http", "--http-host", "a,,b"},
			{"run", "--http", "--http-host", "a b"},
		} {
			if r := idemctl(t, ctx, nil, args...); r.code != ExitUsage {
				t.Errorf("%v: exit %d, want %d\n%s", args, r.code, ExitUsage, r.errout)
			}
		}
	})

	t.Run("served", func(t *testing.T) {
		url := testdb.New(t)
		addr := freeAddr(t)
		_, port, _ := net.SplitHostPort(addr)
		var out, errw testdb.Buffer
		code := make(chan int, 1)
		go func() {
			code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr, "--http",
				"--http-host", "Dash.Example,proxy.example", "--http-host", "other.example"},
				&out, &errw, func(string) string { return "" })
		}()
		with := func(path, host string) int {
			req, err := http.NewRequest(http.MethodGet, "http://"+addr+path, nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Host = host
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return 0 // not listening yet
			}
			resp.Body.Close()
			return resp.StatusCode
		}
		for deadline := time.Now().Add(20 * time.Second); with("/healthz", addr) != 200; time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the daemon does not answer:\n%s", errw.String())
			}
		}
		for host, want := range map[string]int{
			addr:                              200,
			"localhost:" + port:               200,
			"[::1]:" + port:                   200,
			"dash.example":                    200,
			"PROXY.example:443":               200,
			"other.example":                   200,
			"rebind.attacker.example:" + port: http.StatusMisdirectedRequest,
			"example.com":                     http.StatusMisdirectedRequest,
		} {
			if got := with("/maintenance", host); got != want {
				t.Errorf("dashboard with Host %s: %d, want %d", host, got, want)
			}
		}
		if got := with("/healthz", "rebind.attacker.example"); got != 200 {
			t.Errorf("/healthz with another Host: %d", got)
		}
		cancel()
		if c := <-code; c != 0 {
			t.Fatalf("exit %d after shutdown: %s", c, errw.String())
		}
	})
}

// TestLivezDuringOutage: while the database refuses connections, /healthz
// answers 503 (readiness) and /livez 200 (liveness), so a liveness probe
// does not restart the daemon in a loop for the outage; both answer 200
// once the database is back.
func TestLivezDuringOutage(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr,
			"--prune-schedule", "@monthly", "--rotate-schedule", "@monthly", "--stats-schedule", "@monthly"},
			&out, &errw, func(string) string { return "" })
	}()
	status := func(path string) int {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	waitFor(t, func() bool { return status("/healthz") == 200 })
	pool := testdb.Pool(t, url, 1)
	var db string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	pool.Close()
	admin := testdb.Pool(t, testdb.URLFor(t, "postgres"), 1)
	allow := func(on bool) {
		t.Helper()
		if _, err := admin.Exec(ctx, fmt.Sprintf(`ALTER DATABASE %s ALLOW_CONNECTIONS %t`, pgx.Identifier{db}.Sanitize(), on)); err != nil {
			t.Fatal(err)
		}
		if !on {
			if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`, db); err != nil {
				t.Fatal(err)
			}
		}
	}
	allow(false)
	waitFor(t, func() bool { return status("/healthz") == http.StatusServiceUnavailable })
	if s := status("/livez"); s != 200 {
		t.Fatalf("/livez during the outage: %d, want 200", s)
	}
	allow(true)
	waitFor(t, func() bool { return status("/healthz") == 200 && status("/livez") == 200 })
	cancel()
	if c := <-code; c != 0 {
		t.Fatalf("exit %d: %s", c, errw.String())
	}
}
