package cli

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testdb"
)

// Issue 53, item 1: idem's code never calls into an object the application
// owns (migration 24). The application role owns its legacy table, so it
// chooses every object a read of it can call: the read columns' types
// (a domain's CHECK runs on a cast to it, an enum's cast to text on
// ::text, a type's cast to json in to_jsonb), their collations, and the
// expressions of the table's indexes, statistics objects and checks,
// whose constant parts the planner evaluates as whoever plans the read.
// idemctl adopt runs as idem's owner (here a superuser, as documented),
// and adopt_key, SECURITY DEFINER, runs as the owner inside every claim of
// a new key while an adoption copies. Each class is planted by the
// least-privileged application role (idemctl grant --app); nothing may run
// as another role.

// ownedLegacy is a migrated database with an application role granted
// the application's rights and CREATE on public, the functions it plants
// (public.watch records who ran it, and what; public.watch_i is an
// immutable wrapper, as an index or statistics expression needs), and
// the table public.owner_fired they write. It returns the owner's (a
// superuser's) URL and pool, and a pool as the application role.
func ownedLegacy(t *testing.T) (url string, admin, app *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	url = testdb.New(t)
	admin = testdb.Pool(t, url, 2)
	role := loginRole(t, admin, "owned_app")
	if r := idemctl(t, ctx, nil, "grant", "--database-url", url, "--app", role); r.code != 0 {
		t.Fatalf("grant: %+v", r)
	}
	if _, err := admin.Exec(ctx, `
		CREATE TABLE public.owner_fired (by_role text, what text);
		GRANT INSERT ON public.owner_fired TO PUBLIC;
		GRANT USAGE, CREATE ON SCHEMA public TO `+pgx.Identifier{role}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	app = testdb.Pool(t, testdb.AsUser(url, role), 2)
	if _, err := app.Exec(ctx, `
		CREATE FUNCTION public.watch(what text) RETURNS boolean LANGUAGE plpgsql VOLATILE AS $f$
		BEGIN INSERT INTO public.owner_fired VALUES (current_user::text, what); RETURN true; END $f$;
		CREATE FUNCTION public.watch_i(n integer) RETURNS integer LANGUAGE plpgsql IMMUTABLE AS $f$
		BEGIN PERFORM public.watch('immutable ' || n); RETURN n; END $f$`); err != nil {
		t.Fatal(err)
	}
	return url, admin, app
}

// fired empties public.owner_fired and returns what was in it: who ran
// the application's functions, and which.
func fired(t *testing.T, admin *pgxpool.Pool) []string {
	t.Helper()
	rows, err := admin.Query(context.Background(), `DELETE FROM public.owner_fired RETURNING by_role || ': ' || what`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return got
}

const legacyRows = `INSERT INTO public.legacy (k, at) VALUES ('evt_1', now() - interval '1 hour'), ('evt_2', now())`

// TestAdoptRunsNoApplicationCodeByOwnership: idemctl adopt, as idem's
// owner, refuses a legacy table whose read would call into an object of
// the application role (each class planted alone), and runs none of it.
// A default, a generated column, a trigger and a column of the
// application's type that is not read run on writes only: that table is
// adopted, and nothing of the application's runs either.
func TestAdoptRunsNoApplicationCodeByOwnership(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, plant, result string
		adopted             bool
	}{
		{name: "domain with a check calling a function", plant: `
			CREATE DOMAIN public.app_key AS text CHECK (public.watch('domain check'));
			CREATE TABLE public.legacy (k public.app_key, at timestamptz)`},
		{name: "enum with a cast to text", plant: `
			CREATE TYPE public.app_enum AS ENUM ('evt_1', 'evt_2');
			CREATE FUNCTION public.app_enum_text(public.app_enum) RETURNS text LANGUAGE plpgsql AS $f$
			BEGIN PERFORM public.watch('cast to text'); RETURN pg_catalog.textin(pg_catalog.enum_out($1)); END $f$;
			CREATE CAST (public.app_enum AS text) WITH FUNCTION public.app_enum_text(public.app_enum);
			CREATE TABLE public.legacy (k public.app_enum, at timestamptz)`},
		{name: "result of a type with a cast to json", result: "r", plant: `
			CREATE TYPE public.app_outcome AS ENUM ('ok', 'failed');
			CREATE FUNCTION public.app_outcome_json(public.app_outcome) RETURNS json LANGUAGE plpgsql AS $f$
			BEGIN PERFORM public.watch('cast to json'); RETURN '{}'::json; END $f$;
			CREATE CAST (public.app_outcome AS json) WITH FUNCTION public.app_outcome_json(public.app_outcome);
			CREATE TABLE public.legacy (k text, at timestamptz, r public.app_outcome DEFAULT 'ok')`},
		{name: "composite result", result: "r", plant: `
			CREATE TYPE public.app_pair AS (a integer, b text);
			CREATE TABLE public.legacy (k text, at timestamptz, r public.app_pair)`},
		{name: "nondeterministic collation", plant: `
			CREATE COLLATION public.app_ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
			CREATE TABLE public.legacy (k text COLLATE public.app_ci, at timestamptz)`},
		{name: "collation of its own", plant: `
			CREATE COLLATION public.app_c (provider = libc, locale = 'C');
			CREATE TABLE public.legacy (k text COLLATE public.app_c, at timestamptz)`},
		{name: "function in an index", plant: `
			CREATE TABLE public.legacy (k text, at timestamptz, note text);
			CREATE INDEX ON public.legacy ((note || public.watch_i(1)::text))`},
		{name: "operator in an index", plant: `
			CREATE FUNCTION public.app_eq(text, text) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $f$
			BEGIN PERFORM public.watch('operator'); RETURN $1 = $2; END $f$;
			CREATE OPERATOR public.=== (leftarg = text, rightarg = text, function = public.app_eq);
			CREATE TABLE public.legacy (k text, at timestamptz);
			CREATE INDEX ON public.legacy ((k || ('a' OPERATOR(public.===) 'b')::text))`},
		{name: "index predicate", plant: `
			CREATE TABLE public.legacy (k text, at timestamptz);
			CREATE INDEX ON public.legacy (k) WHERE public.watch_i(2) > 0 AND k <> ''`},
		{name: "statistics object", plant: `
			CREATE TABLE public.legacy (k text, at timestamptz);
			CREATE STATISTICS public.app_stats ON (k || public.watch_i(3)::text), at FROM public.legacy`},
		{name: "check constraint", plant: `
			CREATE TABLE public.legacy (k text, at timestamptz, CHECK (public.watch_i(4) > 0))`},
		{name: "default, generated column, trigger, unread column", adopted: true, plant: `
			CREATE TYPE public.app_status AS ENUM ('new', 'done');
			CREATE FUNCTION public.app_id() RETURNS text LANGUAGE plpgsql AS $f$
			BEGIN PERFORM public.watch('default'); RETURN 'evt_0'; END $f$;
			CREATE FUNCTION public.app_trigger() RETURNS trigger LANGUAGE plpgsql AS $f$
			BEGIN PERFORM public.watch('trigger'); RETURN NEW; END $f$;
			CREATE TABLE public.legacy (k text DEFAULT public.app_id(), at timestamptz,
			    g text GENERATED ALWAYS AS (k || public.watch_i(5)::text) STORED, status public.app_status DEFAULT 'done');
			CREATE TRIGGER app_trigger BEFORE INSERT OR UPDATE ON public.legacy FOR EACH ROW EXECUTE FUNCTION public.app_trigger()`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, admin, app := ownedLegacy(t)
			if _, err := app.Exec(ctx, tc.plant+";\n"+legacyRows); err != nil {
				t.Fatal(err)
			}
			fired(t, admin) // what ran as the application itself, planting
			args := []string{"adopt", "--database-url", url, "--table", "public.legacy", "--source", "legacy",
				"--key-column", "k", "--at-column", "at", "--ttl", "720h", "--sleep", "0"}
			if tc.result != "" {
				args = append(args, "--result-column", tc.result)
			}
			r := idemctl(t, ctx, nil, args...)
			if ran := fired(t, admin); len(ran) > 0 {
				t.Errorf("idemctl adopt (exit %d) ran the application's code: %v\n%s", r.code, ran, r.errout)
			}
			if tc.adopted {
				var n int
				if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = 'legacy'`).Scan(&n); r.code != 0 || err != nil || n != 2 {
					t.Fatalf("adopt: exit %d, %d keys adopted (%v), want 2\n%s%s", r.code, n, err, r.out, r.errout)
				}
				return
			}
			if r.code == 0 || !strings.Contains(r.errout, "would run code of a role that is neither a superuser nor idem's owner") {
				t.Fatalf("adopt: exit %d, want a refusal naming what the read would run\n%s%s", r.code, r.out, r.errout)
			}
			var n int
			if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.adoptions`).Scan(&n); err != nil || n != 0 {
				t.Fatalf("%d adoptions started (%v)", n, err)
			}
		})
	}
}

// TestClaimRunsNoApplicationCodeWhileAdopting: an adoption of a plain
// table is copying; the application role then gives the key column its
// domain, or adds an index or statistics object whose expression calls
// its function, and claims a new key (and a legacy one). Each claim looks
// the key up in the legacy table through idem.adopt_key, as idem's owner:
// it is refused (42809), and nothing of the application's runs as the
// owner.
func TestClaimRunsNoApplicationCodeWhileAdopting(t *testing.T) {
	t.Parallel()
	for name, plant := range map[string]string{
		"domain": `CREATE DOMAIN public.app_key AS text CHECK (public.watch('domain check'));
			ALTER TABLE public.legacy ALTER COLUMN k TYPE public.app_key`,
		"index":      `CREATE INDEX ON public.legacy ((k || public.watch_i(1)::text))`,
		"statistics": `CREATE STATISTICS public.app_stats ON (k || public.watch_i(2)::text), at FROM public.legacy`,
		"collation": `CREATE COLLATION public.app_ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
			ALTER TABLE public.legacy ALTER COLUMN k TYPE text COLLATE public.app_ci`,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			_, admin, app := ownedLegacy(t)
			if _, err := app.Exec(ctx, `CREATE TABLE public.legacy (k text PRIMARY KEY, at timestamptz); `+legacyRows); err != nil {
				t.Fatal(err)
			}
			if _, err := admin.Exec(ctx, `SELECT idem.adopt_start('legacy', 'public.legacy'::regclass, 'k', 'at', NULL, '30 days')`); err != nil {
				t.Fatal(err)
			}
			var outcome string
			if err := app.QueryRow(ctx, `SELECT outcome FROM idem.claim('legacy', 'evt_1')`).Scan(&outcome); err != nil || outcome != "completed" {
				t.Fatalf("a legacy key while copying, before the plant: %q %v", outcome, err)
			}
			if _, err := app.Exec(ctx, plant); err != nil {
				t.Fatal(err)
			}
			fired(t, admin)
			for _, key := range []string{"evt_new", "evt_2"} {
				err := app.QueryRow(ctx, `SELECT outcome FROM idem.claim('legacy', $1)`, key).Scan(&outcome)
				if ran := fired(t, admin); len(ran) > 0 {
					t.Errorf("claim of %s while adopting (%q, %v) ran the application's code: %v", key, outcome, err, ran)
				}
				if sqlState(err) != "42809" {
					t.Errorf("claim of %s while adopting a table that runs the application's code: %q %v, want 42809", key, outcome, err)
				}
			}
		})
	}
}

// TestBaseTypeNeedsSuperuser: the one class the application role cannot
// plant: a base type of its own, whose input and output functions every
// read and cast would call, needs a superuser (even its shell), and the
// I/O functions need a language the role may not use (C, internal).
func TestBaseTypeNeedsSuperuser(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, _, app := ownedLegacy(t)
	for _, q := range []string{
		`CREATE TYPE public.app_base`,
		`CREATE FUNCTION public.app_base_in(cstring) RETURNS text LANGUAGE internal AS 'textin'`,
		`CREATE FUNCTION public.app_base_in(cstring) RETURNS text LANGUAGE c AS 'textin'`,
	} {
		if _, err := app.Exec(ctx, q); err == nil {
			t.Errorf("the application role could run %s", q)
		}
	}
}

// TestRiverTablesNotTheApplications: the other tables idem's tools read
// (idemctl inbox list and replay, stats, the dashboard, as the maintainer
// or a superuser) are River's. migrate up makes them as idem's owner; the
// application role, granted the rows it needs (idemctl grant --app), owns
// none of them and cannot give them an index, statistics object, trigger
// or check of its own that a read by another role would run.
func TestRiverTablesNotTheApplications(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, admin, app := ownedLegacy(t)
	if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url); r.code != 0 {
		t.Fatalf("migrate up (River's tables): %+v", r)
	}
	if r := idemctl(t, ctx, nil, "grant", "--database-url", url, "--app", roleOf(t, app)); r.code != 0 {
		t.Fatalf("grant after River's tables: %+v", r)
	}
	var foreign []string
	rows, err := admin.Query(ctx, `
		SELECT c.oid::regclass::text FROM pg_class c
		 WHERE c.relname LIKE 'river\_%' AND c.relkind IN ('r', 'p', 'S')
		   AND NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.oid = c.relowner
		                      AND (r.rolsuper OR r.oid = (SELECT n.nspowner FROM pg_namespace n WHERE n.nspname = 'idem')))`)
	if err != nil {
		t.Fatal(err)
	}
	if foreign, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(foreign) > 0 {
		t.Errorf("River's tables owned by a role other than a superuser or idem's owner: %v", foreign)
	}
	for _, q := range []string{
		`CREATE INDEX ON river_job ((kind || public.watch_i(1)::text))`,
		`CREATE STATISTICS public.app_river ON (kind || public.watch_i(2)::text), queue FROM river_job`,
		`CREATE TRIGGER app_river BEFORE INSERT ON river_job FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()`,
		`ALTER TABLE river_job ADD CHECK (public.watch_i(3) > 0)`,
	} {
		if _, err := app.Exec(ctx, q); err == nil {
			t.Errorf("the application role could run %s", q)
		}
	}
	if ran := fired(t, admin); len(ran) > 0 {
		t.Errorf("the application's code ran: %v", ran)
	}
}

// roleOf is the role pool connects as.
func roleOf(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var role string
	if err := pool.QueryRow(context.Background(), `SELECT current_user`).Scan(&role); err != nil {
		t.Fatal(err)
	}
	return role
}
