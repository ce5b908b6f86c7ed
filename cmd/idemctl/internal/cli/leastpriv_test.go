package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testdb"
)

// loginRole creates a LOGIN role with no rights in idem, dropped after the
// test.
func loginRole(t *testing.T, admin *pgxpool.Pool, prefix string) string {
	t.Helper()
	role := fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(context.Background(), "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = admin.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	return role
}

func sqlState(err error) string {
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return pg.Code
	}
	return ""
}

// TestNobodyStopsMaintenance: a login with no idem rights holds the
// advisory locks maintenance used to take (every id a maintenance lock
// name hashes to) in an idle session; prune, rotate and CALL idem.prune()
// still run to the end, and the role cannot touch the lock table. A second
// instance, while the first one's batch is in flight, is told at once who
// holds the lock instead of waiting for the batch.
func TestNobodyStopsMaintenance(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 4)
	seedRows(t, admin, "exp-", monthStart(time.Now(), 0), 500, true, false)
	dropFutureMonths(t, admin)
	nobody := loginRole(t, admin, "nobody")
	squatter, err := pgx.Connect(ctx, testdb.AsUser(url, nobody))
	if err != nil {
		t.Fatal(err)
	}
	defer squatter.Close(ctx)
	if _, err := squatter.Exec(ctx, `SELECT pg_advisory_lock(1768187247, hashtext('prune')), pg_advisory_lock(1768187247, hashtext('rotate'))`); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`UPDATE idem.maintenance_locks SET holder = 'me'`,
		`SELECT * FROM idem.try_lock('prune', 'me', '1 hour')`,
		`BEGIN; LOCK TABLE idem.maintenance_locks IN ACCESS EXCLUSIVE MODE; COMMIT`,
		`BEGIN; SELECT * FROM idem.maintenance_locks FOR UPDATE; COMMIT`,
	} {
		_, err := squatter.Exec(ctx, q)
		_, _ = squatter.Exec(ctx, `ROLLBACK`)
		if sqlState(err) != "42501" {
			t.Errorf("%s as a role without rights: %v, want permission denied", q, err)
		}
	}

	tctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	for _, args := range [][]string{{"prune"}, {"partitions", "rotate"}} {
		if r := idemctl(t, tctx, nil, append(args, "--database-url", url)...); r.code != 0 || tctx.Err() != nil {
			t.Fatalf("idemctl %s with the advisory locks held by another login: exit %d\n%s%s", strings.Join(args, " "), r.code, r.out, r.errout)
		}
	}
	if n := len(keysLeft(t, admin)); n != 0 {
		t.Errorf("prune left %d expired rows", n)
	}
	p := testdb.Pool(t, url, 1)
	if _, err := p.Exec(tctx, `CALL idem.prune()`); err != nil {
		t.Fatalf("CALL idem.prune(): %v", err)
	}
	if _, err := p.Exec(tctx, `CALL idem.rotate()`); err != nil {
		t.Fatalf("CALL idem.rotate(): %v", err)
	}

	// A batch in flight: the first instance took the lock, and its batch's
	// transaction holds what a batch holds until it commits. A second prune
	// says who holds the lock and exits.
	if _, err := admin.Exec(ctx, `SELECT idem.try_lock('prune', 'first-instance', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	tx, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT idem.prune_batch('first-instance', 10)`); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, tctx, nil, "prune", "--database-url", url, "--fail-if-locked"); r.code != ExitLocked || !strings.Contains(r.errout+r.out, "first-instance") {
		t.Fatalf("a second prune during the first one's batch: exit %d, want %d naming the holder\n%s%s", r.code, ExitLocked, r.out, r.errout)
	}
}

// TestRunAlertsWhenPruneNeverEnds: the daemon's last-success gauge for
// each job exists from its start, so "no successful prune for two hours"
// can fire even when no prune ever succeeds.
func TestRunAlertsWhenPruneNeverEnds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	before := time.Now().Unix()
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr,
			"--prune-schedule", "@every 1h", "--rotate-schedule", "@every 1h", "--stats-schedule", "@every 1h"},
			&out, &errw, func(string) string { return "" })
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		m := scrape(addr)
		if strings.Contains(m, `idem_job_last_success_timestamp_seconds{job="prune"}`) &&
			strings.Contains(m, `idem_job_last_success_timestamp_seconds{job="rotate"}`) {
			var ts float64
			for _, l := range strings.Split(m, "\n") {
				if strings.HasPrefix(l, `idem_job_last_success_timestamp_seconds{job="prune"}`) {
					_, _ = fmt.Sscanf(strings.Fields(l)[1], "%g", &ts)
				}
			}
			if int64(ts) < before {
				t.Fatalf("prune's last success %v is before the daemon started (%d)", ts, before)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no last-success gauge for prune and rotate:\n%s", errw.String())
		}
		time.Sleep(100 * time.Millisecond)
	}
	cancel()
	<-code
}

// TestForeignSchemaOwner: a schema idem created before `migrate up` by the
// application role (or with CREATE granted to it) is refused, with the
// statements that fix it; once fixed, migrate up installs.
func TestForeignSchemaOwner(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, setup := range []struct {
		name, sql, want string
	}{
		{"owned by the app role", `CREATE SCHEMA idem AUTHORIZATION APP`, `ALTER SCHEMA idem OWNER TO`},
		{"CREATE granted to the app role", `CREATE SCHEMA idem; GRANT USAGE, CREATE ON SCHEMA idem TO APP`, `REVOKE CREATE ON SCHEMA idem FROM APP;`},
		{"CREATE granted to PUBLIC", `CREATE SCHEMA idem; GRANT CREATE ON SCHEMA idem TO PUBLIC`, `REVOKE CREATE ON SCHEMA idem FROM PUBLIC;`},
	} {
		t.Run(setup.name, func(t *testing.T) {
			t.Parallel()
			url := testdb.NewEmpty(t)
			admin := testdb.Pool(t, url, 2)
			app := loginRole(t, admin, "schema_app")
			if _, err := admin.Exec(ctx, strings.ReplaceAll(setup.sql, "APP", pgx.Identifier{app}.Sanitize())); err != nil {
				t.Fatal(err)
			}
			r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url, "--river=false")
			want := strings.ReplaceAll(setup.want, "APP", app)
			if r.code == 0 || !strings.Contains(r.errout, want) {
				t.Fatalf("migrate up into a schema %s: exit %d, want a refusal saying %q\n%s%s", setup.name, r.code, want, r.out, r.errout)
			}
			var tables int
			_ = admin.QueryRow(ctx, `SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'idem'`).Scan(&tables)
			if tables != 0 {
				t.Fatalf("the refused migration created %d relations", tables)
			}
			// The statements the message gives, then migrate again.
			msg := r.errout[strings.Index(r.errout, "Run, as its owner or a superuser: ")+len("Run, as its owner or a superuser: "):]
			stmts := msg[:strings.Index(msg, " (then inspect")]
			if _, err := admin.Exec(ctx, stmts); err != nil {
				t.Fatalf("the fix %q: %v", stmts, err)
			}
			if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url, "--river=false"); r.code != 0 {
				t.Fatalf("migrate up after the fix: %+v", r)
			}
		})
	}
}

// TestSquatterPartition: a role with CREATE on schema idem makes a table
// named like next month's partition. Rotation does not take it for the
// partition (ID007, naming the table and its owner), check reports both
// the table and the CREATE right, and once it is dropped rotation makes
// the month.
func TestSquatterPartition(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	dropFutureMonths(t, admin)
	app := loginRole(t, admin, "squatter")
	next := "idem.processed_events_" + pname(monthStart(time.Now(), 1))
	if _, err := admin.Exec(ctx, `GRANT USAGE, CREATE ON SCHEMA idem TO `+pgx.Identifier{app}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	sq := testdb.Pool(t, testdb.AsUser(url, app), 1)
	if _, err := sq.Exec(ctx, `CREATE TABLE `+next+` (source text, key text)`); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url)
	if r.code == 0 || !strings.Contains(r.errout, "idem did not make it") || !strings.Contains(r.errout, next) {
		t.Fatalf("rotate with a squatter: exit %d\n%s%s", r.code, r.out, r.errout)
	}
	if _, err := admin.Exec(ctx, `CALL idem.rotate()`); sqlState(err) != "ID007" {
		t.Fatalf("CALL idem.rotate() with a squatter: %v, want ID007", err)
	}
	r = idemctl(t, ctx, nil, "check", "--database-url", url)
	for _, want := range []string{next + " (owner " + app + ") is named like a month", app + " may create objects in schema idem", "REVOKE CREATE ON SCHEMA idem FROM " + app} {
		if r.code != ExitUnhealthy || !strings.Contains(r.errout, want) {
			t.Fatalf("check with a squatter: exit %d, want %d saying %q\n%s%s", r.code, ExitUnhealthy, want, r.out, r.errout)
		}
	}
	if _, err := admin.Exec(ctx, `DROP TABLE `+next+`; REVOKE CREATE ON SCHEMA idem FROM `+pgx.Identifier{app}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url); r.code != 0 || !strings.Contains(r.out, "created") {
		t.Fatalf("rotate after the fix: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "check", "--database-url", url); r.code != 0 {
		t.Fatalf("check after the fix: %+v", r)
	}
}

// TestGrantNeverBoth: every way to give the application role the
// maintainer's rights through idemctl grant (the same role twice in two
// calls, either order; the app role a member of the maintainer role, or
// the reverse) is refused and leaves no grant behind; a role made both
// behind idemctl's back is reported by check.
func TestGrantNeverBoth(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	granted := func(role string) (app, maint bool) {
		t.Helper()
		if err := admin.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.claim(text, text, text, interval, interval, text, interval)', 'EXECUTE'),
			has_table_privilege($1, 'idem.processed_events', 'SELECT')`, role).Scan(&app, &maint); err != nil {
			t.Fatal(err)
		}
		return app, maint
	}
	t.Run("one role in two calls", func(t *testing.T) {
		for _, order := range [][2]string{{"--app", "--maintainer"}, {"--maintainer", "--app"}} {
			r := loginRole(t, admin, "both")
			if res := idemctl(t, ctx, nil, "grant", "--database-url", url, order[0], r); res.code != 0 {
				t.Fatalf("grant %s: %+v", order[0], res)
			}
			res := idemctl(t, ctx, nil, "grant", "--database-url", url, order[1], r)
			if res.code != ExitUsage || !strings.Contains(res.errout, "would hold both") {
				t.Fatalf("grant %s after %s to one role: exit %d\n%s", order[1], order[0], res.code, res.errout)
			}
			if a, m := granted(r); a && m {
				t.Fatalf("the refused grant %s left both rights", order[1])
			}
		}
	})
	t.Run("membership", func(t *testing.T) {
		app, maint := loginRole(t, admin, "mem_app"), loginRole(t, admin, "mem_maint")
		if res := idemctl(t, ctx, nil, "grant", "--database-url", url, "--app", app, "--maintainer", maint); res.code != 0 {
			t.Fatalf("grant: %+v", res)
		}
		// The app role made a member of the maintainer role, then granted
		// again (a deploy re-running grant): refused.
		if _, err := admin.Exec(ctx, "GRANT "+pgx.Identifier{maint}.Sanitize()+" TO "+pgx.Identifier{app}.Sanitize()); err != nil {
			t.Fatal(err)
		}
		for _, flag := range []string{"--app", "--maintainer"} {
			role := map[string]string{"--app": app, "--maintainer": maint}[flag]
			res := idemctl(t, ctx, nil, "grant", "--database-url", url, flag, role)
			if res.code != ExitUsage || !strings.Contains(res.errout, "role "+app+" would hold both") {
				t.Fatalf("grant %s %s with %s a member of %s: exit %d\n%s", flag, role, app, maint, res.code, res.errout)
			}
		}
		res := idemctl(t, ctx, nil, "check", "--database-url", url)
		if res.code != ExitUnhealthy || !strings.Contains(res.errout, "role "+app+" holds both the application's rights (through "+app+") and the maintainer's (through "+maint+")") {
			t.Fatalf("check with the app role a member of the maintainer role: exit %d\n%s%s", res.code, res.out, res.errout)
		}
	})
}

// TestBoundsCheckedInSQL: CALL idem.rotate() and idem.prune() refuse
// arguments out of range themselves (lock_wait 0 or under a millisecond,
// 600 months ahead, a batch of 0), and idemctl reports the same refusal as
// a usage error (exit 2) before anything runs, timeouts over PostgreSQL's
// limit included.
func TestBoundsCheckedInSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	before := partitionNames(t, admin)
	for _, call := range []string{
		`CALL idem.rotate(lock_wait => '0')`,
		`CALL idem.rotate(lock_wait => '0.4 ms')`,
		`CALL idem.rotate(lock_wait => NULL)`,
		`CALL idem.rotate(lock_wait => '2 hours')`,
		`CALL idem.rotate(premake => 600)`,
		`CALL idem.rotate(premake => -1)`,
		`CALL idem.prune(batch_size => 0)`,
		`CALL idem.prune(max_batches => 0)`,
	} {
		if _, err := admin.Exec(ctx, call); sqlState(err) != "22023" {
			t.Errorf("%s: %v, want 22023", call, err)
		}
	}
	if got := partitionNames(t, admin); fmt.Sprint(got) != fmt.Sprint(before) {
		t.Fatalf("refused calls changed the partitions: %v -> %v", before, got)
	}
	for _, args := range [][]string{
		{"partitions", "rotate", "--premake", "600"},
		{"partitions", "rotate", "--lock-timeout", "400us"},
		{"partitions", "rotate", "--lock-timeout", "1000h"},
		{"prune", "--lock-timeout", "1000h"},
		{"prune", "--statement-timeout", "1000h"},
		{"run", "--rotate-premake", "600", "--listen", ""},
		{"run", "--lock-timeout", "1000h", "--listen", ""},
	} {
		r := idemctl(t, ctx, nil, append(args, "--database-url", url)...)
		if r.code != ExitUsage {
			t.Errorf("idemctl %s: exit %d, want %d\n%s%s", strings.Join(args, " "), r.code, ExitUsage, r.out, r.errout)
		}
	}
}

// TestDefaultPartitionNeverStallsClaims: rotation was not running when the
// month began, so 300,000 of its rows sit in the default partition, which
// every claim reads. Rotation (with a 200ms lock timeout) makes the months
// ahead while claims run from four connections: the rows stay where they
// are (claims find them), each month ahead is attached after a read of the
// default partition under its lock, and no claim waits behind rotation for
// more than that read. Moving the rows, as rotation did before, held the
// default partition's exclusive lock for seconds.
func TestDefaultPartitionNeverStallsClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 8)
	now := time.Now()
	dropFutureMonths(t, admin)
	if _, err := admin.Exec(ctx, `DROP TABLE idem.processed_events_`+pname(monthStart(now, 0))); err != nil {
		t.Fatal(err)
	}
	const rows = 300_000
	seedRows(t, admin, "stray-", monthStart(now, 0), rows, false, false)
	if _, err := admin.Exec(ctx, `ANALYZE idem.processed_events_default`); err != nil {
		t.Fatal(err)
	}

	stop := make(chan struct{})
	longest := make(chan time.Duration, 4)
	for w := range 4 {
		go func() {
			var worst time.Duration
			defer func() { longest <- worst }()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				if _, err := admin.Exec(ctx, `SELECT idem.claim('stall', $1)`, fmt.Sprintf("w%d-%d", w, i)); err != nil {
					t.Errorf("claim: %v", err)
					return
				}
				worst = max(worst, time.Since(start))
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--premake", "3", "--lock-timeout", "200ms")
	time.Sleep(200 * time.Millisecond)
	close(stop)
	var worst time.Duration
	for range 4 {
		worst = max(worst, <-longest)
	}
	if r.code != 0 {
		t.Fatalf("rotate: %+v", r)
	}
	want := []string{pname(monthStart(now, 1)), pname(monthStart(now, 2)), pname(monthStart(now, 3)), "default"}
	if got := partitionNames(t, admin); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("partitions: %v, want %v\n%s", got, want, r.out)
	}
	if !strings.Contains(r.out, "kept: rows of this month are in the default partition") {
		t.Errorf("rotate does not say why the current month has no partition:\n%s", r.out)
	}
	var inDefault int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events_default WHERE key LIKE 'stray-%'`).Scan(&inDefault); err != nil || inDefault != rows {
		t.Fatalf("%d seeded rows left in the default partition (%v), want %d", inDefault, err, rows)
	}
	// A bound, not a benchmark: moving the rows held every claim for
	// seconds; a claim now waits at most for the attach's read.
	t.Logf("longest claim during rotation: %s", worst)
	if worst > 1500*time.Millisecond {
		t.Fatalf("a claim waited %s during rotation (lock timeout 200ms)", worst)
	}
	if r := idemctl(t, ctx, nil, "check", "--database-url", url); r.code != 0 {
		t.Fatalf("check with the month's rows in the default partition: %+v", r)
	}
}
