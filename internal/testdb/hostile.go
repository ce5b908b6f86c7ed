package testdb

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
)

// Lookalikes is what PlantLookalikes left in a database: operators and
// functions in schema public that beat pg_catalog's for an unqualified
// call whose argument types need a cast (CVE-2018-1058). Each one records
// that it ran, and as whom, then answers as the built-in would.
type Lookalikes struct {
	url                  string
	Operators, Functions int
}

// lookalikeTypes are the argument types tried: every type idem's SQL and
// idemctl's queries use, and the ones a cast could come from.
var lookalikeTypes = []string{
	"text", "character varying", "name", `"char"`, "smallint", "integer", "bigint", "numeric",
	"double precision", "real", "boolean", "date", "timestamp without time zone",
	"timestamp with time zone", "interval", "jsonb", "json", "bytea", "oid", "regclass",
	"regrole", "regprocedure", "regtype", "uuid", "text[]", "integer[]", "bigint[]",
}

// lookalikeOperators are the binary operators tried.
var lookalikeOperators = []string{
	"||", "*", "+", "-", "/", "%", "^", "=", "<>", "<", ">", "<=", ">=", "~", "~~", "~~*", "!~",
	"->", "->>", "#>", "#>>", "@>", "<@", "&&", "?",
}

// PlantLookalikes plants, as role (which is given CREATE on public), a
// look-alike in public for every binary operator of lookalikeOperators
// and every function named in funcs or called by a routine of schema idem,
// for each combination of lookalikeTypes that pg_catalog answers only
// through an implicit cast. Fired returns what ran.
func PlantLookalikes(t testing.TB, url, role string, funcs ...string) *Lookalikes {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	r := pgx.Identifier{role}.Sanitize()
	if _, err := conn.Exec(ctx, `
		CREATE TABLE IF NOT EXISTS public.idem_fired (what text, by_role text, at timestamptz DEFAULT pg_catalog.clock_timestamp());
		GRANT INSERT, SELECT ON public.idem_fired TO PUBLIC;
		GRANT USAGE, CREATE ON SCHEMA public TO `+r+`;
		SET ROLE `+r); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, plantFunc); err != nil {
		t.Fatalf("plant look-alikes: %v", err)
	}
	var ops, fns int
	err = conn.QueryRow(ctx, `SELECT * FROM pg_temp.idem_plant($1, $2, $3)`, lookalikeTypes, lookalikeOperators, funcs).Scan(&ops, &fns)
	if err != nil {
		t.Fatalf("plant look-alikes: %v", err)
	}
	if ops < 100 || fns < 20 {
		t.Fatalf("planted only %d operators and %d functions", ops, fns)
	}
	return &Lookalikes{url: url, Operators: ops, Functions: fns}
}

// Fired lists what ran ("bigint * interval as idem_maint"), once each.
func (l *Lookalikes) Fired(t testing.TB) []string {
	t.Helper()
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, l.url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT DISTINCT what || ' as ' || by_role FROM public.idem_fired ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	fired, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return fired
}

// String says how many were planted.
func (l *Lookalikes) String() string {
	return fmt.Sprintf("%d look-alike operators and %d functions", l.Operators, l.Functions)
}

// plantFunc runs server-side: probing thousands of signatures one
// statement each from the client would take minutes. Each candidate is
// planted only where pg_catalog has no exact match (an exact match in
// pg_catalog wins, pg_catalog being searched first) and where pg_catalog
// does answer the call through a cast (so the planted one is what an
// unqualified call would now pick). The planted bodies pin search_path
// and call pg_catalog's, so nothing planted calls another.
const plantFunc = `
CREATE FUNCTION pg_temp.idem_plant(types text[], ops text[], funcs text[], OUT n_ops integer, OUT n_fns integer)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $plant$
DECLARE
    o text; l text; r text; res regtype; fn text; p record; i integer; args text[]; t text; sig text;
    seen text[] := '{}';
BEGIN
    n_ops := 0; n_fns := 0;
    FOREACH o IN ARRAY ops LOOP
      FOREACH l IN ARRAY types LOOP
        FOREACH r IN ARRAY types LOOP
          CONTINUE WHEN EXISTS (SELECT 1 FROM pg_operator x WHERE x.oprnamespace = 'pg_catalog'::regnamespace
                                   AND x.oprname = o AND x.oprleft = l::regtype AND x.oprright = r::regtype);
          BEGIN
            EXECUTE format('SELECT pg_typeof(NULL::%s %s NULL::%s)', l, o, r) INTO res;
          EXCEPTION WHEN OTHERS THEN CONTINUE;
          END;
          CONTINUE WHEN res IS NULL OR res::text IN ('unknown', 'anyelement');
          n_ops := n_ops + 1;
          EXECUTE format($f$CREATE FUNCTION public.idem_lookalike_op_%s(%s, %s) RETURNS %s
              LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $b$
              BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES (%L, current_user::text);
                    RETURN $1 OPERATOR(pg_catalog.%s) $2; END $b$$f$,
              n_ops, l, r, res, format('%s %s %s', l, o, r), o);
          EXECUTE format('CREATE OPERATOR public.%s (LEFTARG = %s, RIGHTARG = %s, FUNCTION = public.idem_lookalike_op_%s)', o, l, r, n_ops);
        END LOOP;
      END LOOP;
    END LOOP;

    -- Functions: named by the caller or called by a routine of schema idem.
    FOR fn IN
        SELECT DISTINCT lower(m[1]) FROM (
            SELECT regexp_matches(x.prosrc, '([A-Za-z_][A-Za-z0-9_]*)\s*\(', 'g') AS m
              FROM pg_proc x WHERE x.pronamespace = 'idem'::regnamespace
            UNION ALL SELECT ARRAY[f] FROM unnest(funcs) f) s
         WHERE EXISTS (SELECT 1 FROM pg_proc c WHERE c.pronamespace = 'pg_catalog'::regnamespace AND c.proname = lower(m[1]))
    LOOP
      FOR p IN SELECT c.oid, c.proargtypes::regtype[] AS a FROM pg_proc c
                WHERE c.pronamespace = 'pg_catalog'::regnamespace AND c.proname = fn AND c.prokind = 'f'
                  AND NOT c.proretset AND c.pronargs BETWEEN 1 AND 3 AND c.provariadic = 0
                  AND NOT EXISTS (SELECT 1 FROM unnest(c.proargtypes) a JOIN pg_type y ON y.oid = a WHERE y.typtype = 'p')
      LOOP
        FOR i IN 1 .. array_length(p.a, 1) LOOP
          FOREACH t IN ARRAY types LOOP
            args := p.a::text[];
            args[i] := t::regtype::text;
            sig := fn || '(' || array_to_string(args, ', ') || ')';
            CONTINUE WHEN sig = ANY (seen);
            seen := seen || sig;
            CONTINUE WHEN to_regprocedure('pg_catalog.' || sig) IS NOT NULL;
            BEGIN
              EXECUTE format('SELECT pg_typeof(%I(%s))', fn,
                             (SELECT string_agg('NULL::' || a, ', ') FROM unnest(args) a)) INTO res;
            EXCEPTION WHEN OTHERS THEN CONTINUE;
            END;
            CONTINUE WHEN res IS NULL OR res::text IN ('unknown', 'anyelement', 'record');
            BEGIN
              EXECUTE format($f$CREATE FUNCTION public.%I(%s) RETURNS %s
                  LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $b$
                  BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES (%L, current_user::text);
                        RETURN pg_catalog.%I(%s); END $b$$f$,
                  fn, array_to_string(args, ', '), res, sig, fn,
                  (SELECT string_agg('$' || g, ', ') FROM generate_series(1, array_length(args, 1)) g));
              n_fns := n_fns + 1;
            EXCEPTION WHEN OTHERS THEN NULL;
            END;
          END LOOP;
        END LOOP;
      END LOOP;
    END LOOP;
END
$plant$`
