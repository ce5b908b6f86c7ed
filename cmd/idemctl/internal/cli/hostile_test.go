package cli

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testdb"
)

// queryFunctions lists the function names idemctl's queries call, for the
// look-alikes to shadow.
func queryFunctions(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("../../../../sql/queries/*.sql")
	if err != nil || len(files) == 0 {
		t.Fatalf("sql/queries: %v", err)
	}
	re := regexp.MustCompile(`([A-Za-z_][A-Za-z0-9_]*)\s*\(`)
	var names []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range re.FindAllStringSubmatch(string(b), -1) {
			names = append(names, strings.ToLower(m[1]))
		}
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// hostileDatabase is a migrated database whose sessions default to a
// non-ISO DateStyle, a non-UTC TimeZone (a half-hour offset) and a verbose
// IntervalStyle, with an application role and a maintainer role granted by
// idemctl grant. It returns the admin (superuser) URL, the maintainer's URL
// and the application role.
func hostileDatabase(t *testing.T) (adminURL, maintURL, app string, admin *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	url := testdb.New(t)
	admin = testdb.Pool(t, url, 4)
	app, maint := loginRole(t, admin, "hostile_app"), loginRole(t, admin, "hostile_maint")
	if r := idemctl(t, ctx, nil, "grant", "--database-url", url, "--app", app, "--maintainer", maint); r.code != 0 {
		t.Fatalf("grant: %+v", r)
	}
	var db string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	d := pgx.Identifier{db}.Sanitize()
	if _, err := admin.Exec(ctx, `ALTER DATABASE `+d+` SET DateStyle = 'SQL, DMY';
		ALTER DATABASE `+d+` SET TimeZone = 'America/St_Johns';
		ALTER DATABASE `+d+` SET IntervalStyle = 'postgres_verbose'`); err != nil {
		t.Fatal(err)
	}
	return url, testdb.AsUser(url, maint), app, admin
}

// TestMaintenanceUnderHostileSettings runs the whole maintenance surface
// (idemctl prune, partitions rotate and list, check, stats, run with its
// jobs, /metrics and the dashboard; CALL idem.prune() and idem.rotate()) as
// the maintainer role and as a superuser, on a database with DateStyle
// 'SQL, DMY', TimeZone America/St_Johns and IntervalStyle
// postgres_verbose, after the application role planted look-alike
// operators and functions in public: every run does its work and nothing
// planted executes.
func TestMaintenanceUnderHostileSettings(t *testing.T) {
	ctx := context.Background()
	url, maintURL, app, admin := hostileDatabase(t)
	now := time.Now()
	plant := testdb.PlantLookalikes(t, url, app, queryFunctions(t)...)
	t.Logf("planted %s", plant)

	// The third: the maintainer with pgx's exec mode (the URL setting for
	// PgBouncer before 1.21), whose results come back as text.
	for _, who := range []struct{ name, url string }{{"maintainer", maintURL}, {"superuser", url}, {"exec mode", withExecMode(maintURL)}} {
		t.Run(who.name, func(t *testing.T) {
			// The work to do: expired rows to prune, an expired past month
			// to retire, the months ahead to make. Seeded as the superuser
			// before the look-alikes' log is cleared.
			if _, err := admin.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(now, -2)); err != nil {
				t.Fatal(err)
			}
			p := strings.ReplaceAll(who.name, " ", "") // the seeded keys' prefix, unique to the run
			seedRows(t, admin, p+"old-", monthStart(now, -2), 200, true, false)
			seedRows(t, admin, p+"exp-", monthStart(now, 0), 300, true, false)
			seedRows(t, admin, p+"live-", monthStart(now, 0), 10, false, false)
			dropFutureMonths(t, admin)
			if _, err := admin.Exec(ctx, `TRUNCATE public.idem_fired`); err != nil {
				t.Fatal(err)
			}

			for _, args := range [][]string{
				{"prune"},
				{"partitions", "rotate", "--premake", "2"},
				{"partitions", "list"},
				{"check"},
				{"stats"},
			} {
				if r := idemctl(t, ctx, nil, append(args, "--database-url", who.url)...); r.code != 0 {
					t.Errorf("idemctl %s: exit %d\n%s%s", strings.Join(args, " "), r.code, r.out, r.errout)
				}
			}
			runOnce(t, who.url)
			sql := testdb.Pool(t, who.url, 1)
			for _, call := range []string{`CALL idem.prune()`, `CALL idem.rotate(premake => 3)`} {
				if _, err := sql.Exec(ctx, call); err != nil {
					t.Errorf("%s: %v", call, err)
				}
			}
			if fired := plant.Fired(t); len(fired) > 0 {
				t.Fatalf("look-alikes ran inside idem's maintenance:\n%s", strings.Join(fired, "\n"))
			}

			// The work was done.
			left := keysLeft(t, admin)
			if left[p+"old"] != 0 || left[p+"exp"] != 0 || left[p+"live"] != 10 {
				t.Errorf("rows left after prune: %v", left)
			}
			want := []string{pname(monthStart(now, 0)), pname(monthStart(now, 1)), pname(monthStart(now, 2)), pname(monthStart(now, 3)), "default"}
			if got := partitionNames(t, admin); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("partitions after rotate: %v, want %v", got, want)
			}
			if r := idemctl(t, ctx, nil, "check", "--database-url", who.url); r.code != 0 {
				t.Errorf("check after maintenance: exit %d\n%s%s", r.code, r.out, r.errout)
			}
		})
	}
}

// runOnce runs `idemctl run` with the dashboard until each job has run,
// reads /healthz, /metrics and every dashboard page, and stops it.
func runOnce(t *testing.T, url string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr, "--http",
			"--prune-schedule", "@every 1s", "--rotate-schedule", "@every 1s", "--stats-schedule", "@every 1s"},
			&out, &errw, func(string) string { return "" })
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		m := scrape(addr)
		if strings.Contains(m, `idem_job_runs_total{job="prune",result="ok"}`) &&
			strings.Contains(m, `idem_job_runs_total{job="rotate",result="ok"}`) &&
			strings.Contains(m, `idem_job_runs_total{job="snapshot",result="ok"}`) {
			break
		}
		if time.Now().After(deadline) {
			var jobs []string
			for _, l := range strings.Split(m, "\n") {
				if strings.HasPrefix(l, "idem_job_runs_total") {
					jobs = append(jobs, l)
				}
			}
			t.Fatalf("run's jobs did not all succeed: %s\n%s", jobs, errw.String())
		}
		select {
		case c := <-code:
			t.Fatalf("run exited with %d: %s", c, errw.String())
		case <-time.After(200 * time.Millisecond):
		}
	}
	for _, path := range []string{"/healthz", "/", "/keys", "/dead", "/maintenance"} {
		if status, body := get(t, "http://"+addr+path); status != 200 {
			t.Errorf("GET %s: %d %s", path, status, body)
		}
	}
	cancel()
	if c := <-code; c != 0 {
		t.Fatalf("run: exit %d\n%s", c, errw.String())
	}
}

// withExecMode adds pgx's exec mode to a URL or a keyword/value string.
func withExecMode(dsn string) string {
	if strings.Contains(dsn, "://") {
		if strings.Contains(dsn, "?") {
			return dsn + "&default_query_exec_mode=exec"
		}
		return dsn + "?default_query_exec_mode=exec"
	}
	return dsn + " default_query_exec_mode=exec"
}

// scrape returns /metrics of the daemon at addr, "" while it is not
// listening yet.
func scrape(addr string) string {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}
