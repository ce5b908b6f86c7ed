package cli

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// Attacks found by a review of the least-privilege work, each reproduced
// before it was mended.

// TestOwnerCommandsUnderLookalikes: the commands idem's owner runs
// (idemctl grant, idemctl migrate up) after the application role planted
// look-alike operators in public, as TestMaintenanceUnderHostileSettings
// does for the maintenance commands. idemctl grant compares
// $1::regrole = $2::regrole (pg_catalog has no regrole = regrole: the
// built-in needs a cast to oid, so public.=(regrole, regrole) wins), and
// inbox.GrantRiver, which grant and migrate up run, filters
// a.grantee <> 0 (oid <> integer: public.<>(oid, integer) wins). Either
// runs the application's code as the owner, often a superuser.
func TestOwnerCommandsUnderLookalikes(t *testing.T) {
	ctx := context.Background()
	url, maintURL, app, admin := hostileDatabase(t)
	app2, maint2 := loginRole(t, admin, "hostile_app2"), loginRole(t, admin, "hostile_maint2")
	plant := testdb.PlantLookalikes(t, url, app, queryFunctions(t)...)
	seedRows(t, admin, "rel-", monthStart(time.Now(), 0), 1, false, false)
	for _, args := range [][]string{
		{"grant", "--app", app2, "--maintainer", maint2},
		{"migrate", "up"},
		{"migrate", "status"},
		// The maintainer's commands the maintenance test does not run.
		{"release", "--source", "seed", "--key", "rel-1", "--maintainer-url"},
		{"inbox", "list", "--maintainer-url"},
		{"inbox", "replay", "--since", "24h", "--maintainer-url"},
	} {
		url := url
		if args[len(args)-1] == "--maintainer-url" {
			args, url = args[:len(args)-1], maintURL
		}
		if _, err := admin.Exec(ctx, `TRUNCATE public.idem_fired`); err != nil {
			t.Fatal(err)
		}
		if r := idemctl(t, ctx, nil, append(args, "--database-url", url)...); r.code != 0 {
			t.Errorf("idemctl %s: exit %d\n%s%s", strings.Join(args, " "), r.code, r.out, r.errout)
		}
		if fired := plant.Fired(t); len(fired) > 0 {
			t.Errorf("look-alikes ran inside idemctl %s:\n%s", strings.Join(args, " "), strings.Join(fired, "\n"))
		}
	}
}

// TestRotateLockWaitBound: idem.check_rotate_args bounds lock_wait to 1ms..1h
// by interval comparison (a year counts 360 days) but derives the
// lock_timeout from extract(epoch) (a year counts 365.25 days), so
// '4 years -1440 days 1 hour' passes as 1 hour and sets a lock_timeout of
// 21 days and 1 hour: CALL idem.rotate(lock_wait => ...) waits that long
// behind a long transaction while claims queue behind its lock request.
func TestRotateLockWaitBound(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	admin := testdb.Pool(t, testdb.New(t), 1)
	var ms string
	err := admin.QueryRow(ctx, `SELECT idem.check_rotate_args(3, interval '4 years -1440 days 1 hour')`).Scan(&ms)
	if err == nil {
		t.Fatalf("lock_wait '4 years -1440 days 1 hour' accepted as a lock_timeout of %s ms (the bound is 1h = 3600000 ms)", ms)
	}
}

// TestAdoptRunsNoApplicationCode: the application role owns its legacy
// table, so it can turn it into a view (same name) whose WHERE calls its
// own function. idemctl adopt, run by idem's owner (here a superuser),
// reads it with idem.adopt_start/adopt_batch, which are not SECURITY
// DEFINER and accept any relation: the function runs as the owner.
func TestAdoptRunsNoApplicationCode(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	app := loginRole(t, admin, "adopt_app")
	if _, err := admin.Exec(ctx, `
		CREATE TABLE public.adopt_fired (by_role text);
		GRANT INSERT ON public.adopt_fired TO PUBLIC;
		GRANT USAGE, CREATE ON SCHEMA public TO `+pgx.Identifier{app}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	appPool := testdb.Pool(t, testdb.AsUser(url, app), 1)
	if _, err := appPool.Exec(ctx, `
		CREATE TABLE public.legacy_rows (event_id text PRIMARY KEY, processed_at timestamptz NOT NULL);
		INSERT INTO public.legacy_rows VALUES ('evt_1', now() - interval '1 hour'), ('evt_2', now());
		CREATE FUNCTION public.legacy_watch() RETURNS boolean LANGUAGE plpgsql VOLATILE AS $f$
		BEGIN INSERT INTO public.adopt_fired VALUES (current_user::text); RETURN true; END $f$;
		CREATE VIEW public.legacy_events AS
		    SELECT r.event_id, r.processed_at FROM public.legacy_rows r WHERE public.legacy_watch();
		GRANT SELECT ON public.legacy_events TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, nil, "adopt", "--database-url", url, "--table", "public.legacy_events", "--source", "legacy",
		"--key-column", "event_id", "--at-column", "processed_at", "--ttl", "720h", "--sleep", "0")
	var fired []string
	rows, err := admin.Query(ctx, `SELECT DISTINCT by_role FROM public.adopt_fired`)
	if err != nil {
		t.Fatal(err)
	}
	if fired, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(fired) > 0 {
		t.Fatalf("idemctl adopt (exit %d) ran the application role's function as %v", r.code, fired)
	}
}

// TestKeepDetachedStaysHealthy: every month made before version 14 (by
// migrations 1 to 13's idem.create_partition: on a fresh install the
// current month and the three ahead) has no idem_month check. Retired
// with --keep-detached, as documented, the kept table is reported by
// idem.audit() as "named like a month of idem.processed_events but is not
// its partition", and idemctl check is unhealthy (exit 5) until somebody
// drops the table --keep-detached was asked to keep.
func TestKeepDetachedStaysHealthy(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	now := time.Now()
	old := monthStart(now, -2)
	name := "processed_events_" + pname(old)
	// The month as version 13's create_partition made it (as the months of
	// a fresh install still are).
	if _, err := admin.Exec(ctx, fmt.Sprintf(`
		CREATE TABLE idem.%[1]s (LIKE idem.processed_events INCLUDING DEFAULTS INCLUDING CONSTRAINTS INCLUDING INDEXES) WITH (fillfactor = 85);
		ALTER TABLE idem.processed_events ATTACH PARTITION idem.%[1]s FOR VALUES FROM ('%[2]s') TO ('%[3]s')`,
		name, old.Format("2006-01-02"), monthStart(now, -1).Format("2006-01-02"))); err != nil {
		t.Fatal(err)
	}
	seedRows(t, admin, "old-", old, 10, true, false)
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--keep-detached", "--database-url", url); r.code != 0 {
		t.Fatalf("rotate --keep-detached: exit %d\n%s%s", r.code, r.out, r.errout)
	}
	var kept bool
	if err := admin.QueryRow(ctx, `SELECT to_regclass('idem.`+name+`') IS NOT NULL`).Scan(&kept); err != nil || !kept {
		t.Fatalf("the retired month was not kept (%v)", err)
	}
	if r := idemctl(t, ctx, nil, "check", "--database-url", url); r.code != 0 {
		t.Fatalf("check after rotate --keep-detached: exit %d\n%s%s", r.code, r.out, r.errout)
	}
}

// TestMakeMonthBounds: idem.make_month and idem.create_partition,
// granted to the maintainer, take any month: the bound rotate's premake
// has (0 to 24 months ahead, idem.check_rotate_args: "every partition is
// one more that each claim's plan carries") is skipped by calling them
// directly, as CALL idem.rotate(premake => 600) was before version 14.
// Months far ahead are never retired (only past months are).
func TestMakeMonthBounds(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	maint := loginRole(t, admin, "step_maint")
	if r := idemctl(t, ctx, nil, "grant", "--database-url", url, "--maintainer", maint); r.code != 0 {
		t.Fatalf("grant: %+v", r)
	}
	m := testdb.Pool(t, testdb.AsUser(url, maint), 1)
	far := monthStart(time.Now(), 600)
	for i, q := range []string{`SELECT idem.make_month($1)`, `SELECT coalesce(idem.create_partition($1), 'NULL')`} {
		month := far.AddDate(0, i, 0)
		var res string
		if err := m.QueryRow(ctx, q, month).Scan(&res); err == nil {
			t.Errorf("%s for %s, %d months ahead, as the maintainer: %q, want a refusal (22023)", q, month.Format("2006-01"), 600+i, res)
		}
	}
}

// TestCheckReportsForeignObjectsInIdem: a role given CREATE on schema idem
// (which check reports) plants an overload of one of idem's functions,
// idem.record_run(text, timestamptz, text, text, text, text): the
// procedures call idem.record_run('prune', v_start, 'skipped', '{}', NULL,
// v_holder), and an unknown literal prefers the string category, so the
// planted overload beats idem's (figures jsonb). Once CREATE is revoked
// (the fix check gives), check reports nothing, and CALL idem.prune() run
// by a superuser (pg_cron) while another prune holds the lease runs the
// planted function as the superuser. (Left executable by PUBLIC, check
// reports it only as a PUBLIC grant, whose fix leaves it in place.)
func TestCheckReportsForeignObjectsInIdem(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	app := loginRole(t, admin, "idem_planter")
	id := pgx.Identifier{app}.Sanitize()
	if _, err := admin.Exec(ctx, `
		CREATE TABLE public.planted_fired (by_role text);
		GRANT INSERT ON public.planted_fired TO PUBLIC;
		GRANT USAGE, CREATE ON SCHEMA idem TO `+id); err != nil {
		t.Fatal(err)
	}
	ap := testdb.Pool(t, testdb.AsUser(url, app), 1)
	if _, err := ap.Exec(ctx, `
		CREATE FUNCTION idem.record_run(text, timestamptz, text, text, text, text) RETURNS void
		    LANGUAGE sql AS $f$ INSERT INTO public.planted_fired VALUES (current_user::text) $f$;
		REVOKE ALL ON FUNCTION idem.record_run(text, timestamptz, text, text, text, text) FROM PUBLIC`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `REVOKE CREATE ON SCHEMA idem FROM `+id); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, nil, "check", "--database-url", url)
	t.Logf("check: exit %d\n%s%s", r.code, r.out, r.errout)
	// Another prune holds the lease: the procedure records a skipped run.
	if _, err := admin.Exec(ctx, `SELECT idem.try_lock('prune', 'other', interval '1 minute')`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `CALL idem.prune()`); err != nil {
		t.Fatal(err)
	}
	var fired []string
	rows, err := admin.Query(ctx, `SELECT DISTINCT by_role FROM public.planted_fired`)
	if err != nil {
		t.Fatal(err)
	}
	if fired, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if r.code == 0 || !strings.Contains(r.errout, "idem.record_run") {
		t.Errorf("check with a function of %s in schema idem: exit %d, reports nothing about it\n%s%s", app, r.code, r.out, r.errout)
	}
	if len(fired) > 0 {
		t.Errorf("CALL idem.prune() ran the planted idem.record_run overload as %v", fired)
	}
}

// TestAppCannotHalfMakeAMonth: the application role holds a claim's
// transaction open (every claim locks the default partition) while
// rotation makes next month. The attach gives up after --lock-timeout and
// leaves nothing behind: once the month is current its claims land in the
// default partition. (A CHECK constraint on the default partition, added
// in a step of its own to spare the attach its read, would have stayed and
// refused every claim of the month: that design was tried and dropped.)
func TestAppCannotHalfMakeAMonth(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	now := time.Now()
	dropFutureMonths(t, admin)
	seedRows(t, admin, "stray-", monthStart(now, -1), 5, false, false)
	app := loginRole(t, admin, "holder_app")
	if r := idemctl(t, ctx, nil, "grant", "--database-url", url, "--app", app); r.code != 0 {
		t.Fatalf("grant: %+v", r)
	}
	conn, err := pgx.Connect(ctx, testdb.AsUser(url, app))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT * FROM idem.claim('shop', 'held-open')`); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, nil, "partitions", "rotate", "--lock-timeout", "100ms", "--retries", "1", "--database-url", url)
	if r.code == 0 || !strings.Contains(r.out, "gave up") {
		t.Fatalf("rotate while the role holds its transaction: exit %d, want it to give up\n%s%s", r.code, r.out, r.errout)
	}
	var left int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_constraint WHERE conrelid = 'idem.processed_events_default'::regclass AND contype = 'c' AND conislocal`).Scan(&left); err != nil || left != 0 {
		t.Fatalf("rotation left %d check constraints on the default partition (%v)", left, err)
	}
	next := testdb.PoolAt(t, url, 1, monthStart(now, 1).Add(time.Hour))
	if _, err := next.Exec(ctx, `SELECT * FROM idem.claim('shop', 'first-of-the-month')`); err != nil {
		t.Fatalf("a claim in the month the application role kept half-made: %v", err)
	}
}

// TestSubMillisecondStatementTimeout: PostgreSQL's statement_timeout is in
// whole milliseconds and 0 means none. --statement-timeout 500us is
// accepted and sent as 0, so prune and rotate run without any statement
// timeout, the sub-millisecond trap item 7 of issue 34 closed for
// lock_wait. It should be a usage error (exit 2), as --lock-timeout 500us is.
func TestSubMillisecondStatementTimeout(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	for _, args := range [][]string{{"prune"}, {"partitions", "rotate"}} {
		r := idemctl(t, ctx, nil, append(args, "--statement-timeout", "500us", "--database-url", url)...)
		if r.code != ExitUsage {
			t.Errorf("idemctl %s --statement-timeout 500us: exit %d, want %d (usage)\n%s%s", strings.Join(args, " "), r.code, ExitUsage, r.out, r.errout)
		}
	}
}

// TestNobodyStopsMigrate: a login with no rights in idem holds, in an
// idle session, the advisory lock ids of idem's and River's migration
// steps, and of idem's online index builds. migrate up on an installed, up-to-date schema takes no lock and
// finishes (River's step waited for ever on every run before). With a
// step pending it would wait migrate.LockWait, then fail with ErrLocked
// naming how to find the holder.
func TestNobodyStopsMigrate(t *testing.T) {
	t.Parallel()
	for _, id := range []int64{migrate.LockID, inbox.MigrateLockID, migrate.OnlineLockID} {
		t.Run(fmt.Sprint(id), func(t *testing.T) {
			t.Parallel()
			url := testdb.New(t)
			admin := testdb.Pool(t, url, 1)
			if r := idemctl(t, context.Background(), nil, "migrate", "up", "--database-url", url); r.code != 0 {
				t.Fatalf("migrate up (River's tables): %+v", r)
			}
			nobody := loginRole(t, admin, "nobody")
			conn, err := pgx.Connect(context.Background(), testdb.AsUser(url, nobody))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(context.Background())
			if _, err := conn.Exec(context.Background(), `SELECT pg_advisory_lock($1)`, id); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url)
			if ctx.Err() != nil || r.code != 0 {
				t.Fatalf("migrate up while %s holds advisory lock %d: exit %d after %v (context: %v)\n%s%s",
					nobody, id, r.code, 20*time.Second, ctx.Err(), r.out, r.errout)
			}
		})
	}
}

// TestFreshInstallUnderLookalikes: idem installed into an application's
// database where the application role already planted look-alikes in
// public (the default before PostgreSQL 15): migrate up, as the owner,
// runs migrations 1 to 14 (their DO blocks and top-level statements run
// with the session's search_path) and River's migrations. Migration 5's
// top-level SELECT idem.raise_lookback(p.source, idem.days_at_most(...))
// runs idem.days_at_most (which pins no search_path: float8 * integer,
// float8 >= integer, float8 / numeric) and migration 4's DO block compares
// p.oid = 'idem.clock()'::regprocedure (oid = regprocedure): the
// application's operators run as the migrating superuser.
func TestFreshInstallUnderLookalikes(t *testing.T) {
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	admin := testdb.Pool(t, url, 2)
	app := loginRole(t, admin, "fresh_app")
	// PlantLookalikes reads schema idem's routines: an empty schema idem
	// owned by the migrating role, which migrate up accepts.
	if _, err := admin.Exec(ctx, `CREATE SCHEMA idem`); err != nil {
		t.Fatal(err)
	}
	plant := testdb.PlantLookalikes(t, url, app, queryFunctions(t)...)
	if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url); r.code != 0 {
		t.Fatalf("migrate up: exit %d\n%s%s", r.code, r.out, r.errout)
	}
	if fired := plant.Fired(t); len(fired) > 0 {
		t.Fatalf("look-alikes ran inside migrate up on a fresh install:\n%s", strings.Join(fired, "\n"))
	}
}

// TestSuperuserUpgradeKeepsRotation: idem installed by a dedicated owner
// role, then `migrate up` run by a superuser (a DBA's upgrade). It is
// refused, naming the role to migrate as: moving the schema to the
// superuser (the fix printed before) left idem's SECURITY DEFINER routines
// owned by a role without rights on schema idem, and rotation failed
// (42501). Migrated as the owner, rotation and check work.
func TestSuperuserUpgradeKeepsRotation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	admin := testdb.Pool(t, url, 2)
	owner := loginRole(t, admin, "idem_owner")
	if _, err := admin.Exec(ctx, `DO $$ BEGIN EXECUTE format('GRANT CREATE ON DATABASE %I TO `+owner+`', current_database()); END $$`); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, nil, "migrate", "up", "--river=false", "--database-url", testdb.AsUser(url, owner)); r.code != 0 {
		t.Fatalf("migrate up as %s: %+v", owner, r)
	}
	r := idemctl(t, ctx, nil, "migrate", "up", "--river=false", "--database-url", url)
	if r.code == 0 || !strings.Contains(r.errout, "Migrate as "+owner) || strings.Contains(r.errout, "ALTER SCHEMA") {
		t.Fatalf("migrate up as the superuser: exit %d, want a refusal naming %s\n%s", r.code, owner, r.errout)
	}
	if r := idemctl(t, ctx, nil, "migrate", "up", "--river=false", "--database-url", testdb.AsUser(url, owner)); r.code != 0 {
		t.Fatalf("migrate up as the owner again: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url); r.code != 0 {
		t.Fatalf("rotate after the upgrade: exit %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, nil, "check", "--database-url", url); r.code != 0 {
		t.Fatalf("check after the upgrade: exit %d\n%s%s", r.code, r.out, r.errout)
	}
}
