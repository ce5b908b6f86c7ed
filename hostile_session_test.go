package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// hostileRole makes a role for the test (dropped with what it owns when
// the test ends) and returns its name.
func hostileRole(t *testing.T, admin *pgxpool.Pool, prefix string) string {
	t.Helper()
	role := fmt.Sprintf("%s_%d", prefix, time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(context.Background(), `CREATE ROLE `+role+` NOLOGIN`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role)
	})
	return role
}

// appPool is a pool whose connections run as role after the statements
// set (the session settings another client of a pooled connection may
// have left), in pgx mode mode.
func appPool(t *testing.T, url, role, set string, mode pgx.QueryExecMode) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	if mode != 0 {
		cfg.ConnConfig.DefaultQueryExecMode = mode
	}
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		if _, err := c.Exec(ctx, `SET ROLE `+role, pgx.QueryExecModeSimpleProtocol); err != nil {
			return err
		}
		if set != "" {
			_, err := c.Exec(ctx, set, pgx.QueryExecModeSimpleProtocol)
			return err
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// exerciseClient runs the client's protocol calls on source (each call on
// keys of its own under prefix) and fails t when an answer is wrong: Claim
// with ttl, lease and lock wait, its timestamps read back as instants
// around now; Extend; Complete with a result of backslashes, quotes and
// non-ASCII text, and its duplicate answered that result and counted once;
// ClaimBatch with a repeated key, DoBatch, Peek; and a waiting duplicate
// (Do with WithWait) answered the original's result and counted once.
// counts is what one duplicate counts: 1, or 0 when the session's claims
// run in SERIALIZABLE (which counts nothing).
func exerciseClient(t *testing.T, admin *pgxpool.Pool, c *idem.Client, source, prefix string, counts int) {
	t.Helper()
	ctx := context.Background()
	count := func() (n int) {
		t.Helper()
		if err := admin.QueryRow(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = $1`, source).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	sane := func(what string, at time.Time) {
		t.Helper()
		if d := time.Since(at); at.IsZero() || d > 10*time.Minute || d < -10*time.Minute {
			t.Errorf("%s: %v, %v from now", what, at, -d)
		}
	}
	k := prefix + "-1"
	cl, err := c.Claim(ctx, source, k, idem.WithTTL(48*time.Hour), idem.WithLease(time.Minute), idem.WithLockWait(time.Second))
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if cl.Outcome != idem.Acquired || cl.Token == 0 || cl.Attempt != 1 || cl.LeaseRemaining != time.Minute {
		t.Fatalf("claim: %+v", cl)
	}
	sane("first_seen", cl.FirstSeen)
	if l := cl.LeaseExpiresAt.Sub(cl.FirstSeen); l != time.Minute {
		t.Errorf("claim: lease_expires_at - first_seen = %v, want 1m", l)
	}
	if e := cl.ExpiresAt.Sub(cl.FirstSeen); e != 48*time.Hour {
		t.Errorf("claim: expires_at - first_seen = %v, want 48h", e)
	}
	if until, err := c.Extend(ctx, source, k, cl.Token, 2*time.Minute); err != nil || until.Before(cl.LeaseExpiresAt) {
		t.Errorf("extend: %v %v", until, err)
	}
	result := json.RawMessage(`{"path":"C:\\tmp\\x","q":"it's \"x\"","s":"Grüße ✓"}`)
	if err := c.Complete(ctx, source, k, cl.Token, result); err != nil {
		t.Fatalf("complete: %v", err)
	}
	before := count()
	dup, err := c.Claim(ctx, source, k)
	if err != nil || dup.Outcome != idem.Completed {
		t.Fatalf("duplicate: %+v %v", dup, err)
	}
	var got, want any
	if json.Unmarshal(dup.Result, &got) != nil || json.Unmarshal(result, &want) != nil || fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("duplicate's result %s, want %s", dup.Result, result)
	}
	if !dup.FirstSeen.Equal(cl.FirstSeen) || !dup.ExpiresAt.Equal(cl.ExpiresAt) {
		t.Errorf("duplicate: first_seen %v expires_at %v, want %v %v", dup.FirstSeen, dup.ExpiresAt, cl.FirstSeen, cl.ExpiresAt)
	}
	if n := count() - before; n != counts {
		t.Errorf("a duplicate counted %d times, want %d", n, counts)
	}

	b := prefix + "-b"
	cls, err := c.ClaimBatch(ctx, source, []idem.BatchItem{{Key: k}, {Key: b, Fingerprint: "f"}, {Key: b, Fingerprint: "f"}})
	if err != nil {
		t.Fatalf("batch: %v", err)
	}
	if cls[0].Outcome != idem.Completed || cls[1].Outcome != idem.Acquired || cls[2].Outcome != idem.InProgress {
		t.Fatalf("batch: %s %s %s, want completed acquired in_progress", cls[0].Outcome, cls[1].Outcome, cls[2].Outcome)
	}
	sane("batch first_seen", cls[1].FirstSeen)
	if !cls[0].FirstSeen.Equal(cl.FirstSeen) {
		t.Errorf("batch: the completed key's first_seen %v, want %v", cls[0].FirstSeen, cl.FirstSeen)
	}
	if err := c.Complete(ctx, source, b, cls[1].Token, json.RawMessage(`2`)); err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	res, err := c.DoBatch(ctx, source, []idem.BatchItem{{Key: prefix + "-d1"}, {Key: b, Fingerprint: "f"}, {Key: prefix + "-d1"}},
		func(_ context.Context, a []*idem.Claim) ([]idem.WorkResult, error) {
			ran.Add(int32(len(a)))
			out := make([]idem.WorkResult, len(a))
			for i := range a {
				out[i] = idem.WorkResult{Value: "done"}
			}
			return out, nil
		})
	if err != nil || res[0].Err != nil || res[1].Err != nil || string(res[1].Result.Result) != "2" || ran.Load() != 1 {
		t.Fatalf("DoBatch: %+v %v (ran %d, want 1)", res, err, ran.Load())
	}
	if st, err := c.Peek(ctx, source, prefix+"-d1"); err != nil || st != "completed" {
		t.Errorf("peek: %q %v", st, err)
	}

	// A waiting duplicate: its first claim finds the key in progress and is
	// counted; its claim after the wait (idem.uncounted: the transaction's
	// start time as text, in the session's DateStyle) is not.
	w := prefix + "-w"
	orig, err := c.Claim(ctx, source, w)
	if err != nil || orig.Outcome != idem.Acquired {
		t.Fatalf("wait: %+v %v", orig, err)
	}
	before = count()
	done := make(chan error, 1)
	var waited *idem.Result
	go func() {
		var err error
		waited, err = c.Do(ctx, source, w, func(context.Context) (any, error) {
			return nil, errors.New("the waiter ran the work")
		}, idem.WithWait(time.Minute))
		done <- err
	}()
	// The waiter's first claim found the key in progress: it counted the
	// duplicate, or (SERIALIZABLE, counting nothing) registered its wait
	// (the pgx client; the database/sql client polls, unregistered, and
	// is then completed under it a moment later).
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var waiting bool
		if err := admin.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM idem.waiters WHERE source = $1 AND key = $2)`, source, w).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting || count() > before {
			break
		}
	}
	if err := c.Complete(ctx, source, w, orig.Token, json.RawMessage(`"w"`)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil || waited == nil || string(waited.Result) != `"w"` {
		t.Fatalf("the waiter: %+v %v", waited, err)
	}
	if n := count() - before; n != counts {
		t.Errorf("a waiting duplicate counted %d times, want %d", n, counts)
	}
}

// TestHostileSessionSettings: the session settings a client of a pooled
// connection can leave behind (any role can set them, and a
// transaction-mode pooler carries them to the next client), on the
// application role's connection, for every protocol call of the pgx
// client in each of pgx's modes (the statement cache; exec and simple
// protocol, which PgBouncer setups use and the adaptive client switches to)
// and of the database/sql client: every answer is right, timestamps are
// the instants the database wrote, duplicates are counted once, a waiting
// duplicate once. Before, in exec and simple-protocol modes, a DateStyle
// other than ISO made every claim and batch fail after the database had
// acquired its keys (pgx reads timestamps in text only in ISO).
// standard_conforming_strings = off in simple-protocol mode is refused by
// pgx before anything is sent; default_transaction_isolation = 'repeatable
// read' is refused by idem (ErrIsolationNotSupported), nothing written;
// with default_transaction_read_only = on a completed key's duplicate is
// answered and a new key refused, nothing run.
func TestHostileSessionSettings(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 4)
	app := hostileRole(t, admin, "settings_app")
	if _, err := admin.Exec(ctx, `SELECT idem.grant_app($1)`, app); err != nil {
		t.Fatal(err)
	}
	var mark string
	if err := admin.QueryRow(ctx, `SELECT now()::text`).Scan(&mark); err != nil {
		t.Fatal(err)
	}
	settings := []string{
		`SET DateStyle = 'SQL, DMY'`,
		`SET DateStyle = 'German'`,
		`SET DateStyle = 'Postgres, MDY'`,
		`SET IntervalStyle = 'sql_standard'`,
		`SET IntervalStyle = 'iso_8601'`,
		`SET TimeZone = 'America/St_Johns'`,
		`SET TimeZone = '+14'`,
		`SET TimeZone = '<+0330>-03:30'`, // POSIX: the sign inverted
		`SET extra_float_digits = -15`,
		`SET lc_monetary = 'C'`,
		`SET bytea_output = 'escape'`,
		`SET standard_conforming_strings = off`,
		`SET default_transaction_isolation = 'serializable'`,
		`SET default_transaction_isolation = 'repeatable read'`,
		`SET default_transaction_read_only = on`,
		`SET DateStyle = 'SQL, DMY'; SET IntervalStyle = 'iso_8601'; SET TimeZone = '<-14>+14'; SET extra_float_digits = -15; SET bytea_output = 'escape'`,
		// idem's own settings, left by another client: 'on', and another
		// transaction's start time as text (also in another DateStyle).
		`SELECT set_config('idem.uncounted', 'on', false), set_config('idem.citus', 'on', false), set_config('idem.sampled_minute', '2000-01-01 00:00:00+00', false)`,
		`SET DateStyle = 'SQL, DMY'; SELECT set_config('idem.uncounted', '` + mark + `', false)`,
		`SET DateStyle = 'SQL, DMY'; SELECT set_config('idem.uncounted', pg_catalog.now()::text, false)`,
	}
	modes := []struct {
		name string
		mode pgx.QueryExecMode
	}{{"cache", 0}, {"exec", pgx.QueryExecModeExec}, {"simple", pgx.QueryExecModeSimpleProtocol}}
	for i, set := range settings {
		for _, m := range modes {
			for _, drv := range []string{"pgx", "sql"} {
				t.Run(fmt.Sprintf("%d/%s/%s", i, m.name, drv), func(t *testing.T) {
					source := fmt.Sprintf("set%d-%s-%s", i, m.name, drv)
					countEvery(t, admin, source)
					pool := appPool(t, url, app, set, m.mode)
					var c *idem.Client
					if drv == "pgx" {
						c = testdb.Client(t, pool, &idem.Config{QueryExecMode: m.mode})
					} else {
						db := stdlib.OpenDBFromPool(pool)
						t.Cleanup(func() { db.Close() })
						c = testdb.SQLClient(t, db, nil)
					}
					if strings.Contains(set, "read_only") {
						// Read-only transactions (as on a hot standby): a
						// completed key's duplicate is answered from its
						// row; a new key is refused (25006), nothing
						// written, nothing run.
						if _, err := admin.Exec(ctx, `SELECT idem.complete($1, 'done', c.token, '1') FROM idem.claim($1, 'done') c`, source); err != nil {
							t.Fatal(err)
						}
						if d, err := c.Claim(ctx, source, "done"); err != nil || d.Outcome != idem.Completed || string(d.Result) != "1" {
							t.Fatalf("a duplicate in a read-only session: %+v %v", d, err)
						}
						ran := false
						_, err := c.Do(ctx, source, "new", func(context.Context) (any, error) { ran = true; return nil, nil })
						var n int
						if qerr := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = $1`, source).Scan(&n); qerr != nil || n != 1 ||
							err == nil || ran {
							t.Fatalf("a new key in a read-only session: ran %v, %v, %d rows", ran, err, n)
						}
						return
					}
					if strings.Contains(set, "repeatable read") {
						// idem.claim and idem.claim_batch refuse REPEATABLE
						// READ (its snapshot cannot see a claim committed
						// into another month): ErrIsolationNotSupported,
						// nothing written.
						_, err := c.Claim(ctx, source, "k")
						_, berr := c.ClaimBatch(ctx, source, []idem.BatchItem{{Key: "b"}})
						var n int
						if qerr := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = $1`, source).Scan(&n); qerr != nil || n != 0 ||
							!errors.Is(err, idem.ErrIsolationNotSupported) || !errors.Is(berr, idem.ErrIsolationNotSupported) {
							t.Fatalf("REPEATABLE READ by the session's default: %v, %v, %d rows written", err, berr, n)
						}
						return
					}
					if strings.Contains(set, "standard_conforming_strings") && m.mode == pgx.QueryExecModeSimpleProtocol {
						_, err := c.Claim(ctx, source, "k")
						var n int
						if qerr := admin.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE source = $1`, source).Scan(&n); qerr != nil || n != 0 || err == nil ||
							!strings.Contains(err.Error(), "standard_conforming_strings") {
							t.Fatalf("simple protocol with standard_conforming_strings = off: %v, %d rows written", err, n)
						}
						return
					}
					counts := 1
					if strings.Contains(set, "serializable") {
						counts = 0
					}
					exerciseClient(t, admin, c, source, "k", counts)
				})
			}
		}
	}
}

// TestClientStatementsIgnoreOtherRolesObjects: another role that may
// create objects in a schema on the application role's search_path
// (public: every role could before PostgreSQL 15, and a database owner
// or a grant still can) plants look-alike operators and functions there,
// among them ones that beat pg_catalog's for the client's own statements
// (bigint * interval, which pg_catalog answers through a cast;
// unnest(text[]), which pg_catalog answers through anyarray; and, for a
// search_path that puts public before pg_catalog, the operators and
// functions of the statements' exact signatures). The client's protocol
// calls, with the default search_path and with "public, pg_catalog",
// answer right and run none of them: a look-alike run by the client would
// run the other role's code with the application role's rights (claim,
// complete and fail any key). Before, the claim's ttl, lease and lock
// wait, Extend's lease and a waiter's wait ran the planted bigint *
// interval as the application role, and the client's schema check (before
// its first claim) ran the planted unnest. (A type another role names
// text or jsonb in a schema listed before pg_catalog would still be the
// statements' casts': PostgreSQL's own advice is never to list a schema
// others can write before pg_catalog.)
func TestClientStatementsIgnoreOtherRolesObjects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 4)
	app := hostileRole(t, admin, "victim_app")
	other := hostileRole(t, admin, "other_tenant")
	if _, err := admin.Exec(ctx, `SELECT idem.grant_app($1)`, app); err != nil {
		t.Fatal(err)
	}
	plant := testdb.PlantLookalikes(t, url, other, "unnest", "string_to_array", "string_agg", "floor", "round",
		"date_part", "to_regprocedure", "to_regclass", "current_setting", "set_config", "now", "coalesce",
		"pg_current_xact_id_if_assigned", "pg_notify")
	// Exact signatures, which win for a search_path with public before
	// pg_catalog, and the polymorphic unnest, which PlantLookalikes leaves
	// out.
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SET ROLE `+other+`;
		CREATE FUNCTION public.unnest(text[]) RETURNS SETOF text LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('unnest(text[])', current_user::text);
		      RETURN QUERY SELECT pg_catalog.unnest($1); END $$;
		CREATE FUNCTION public.evil_mul(double precision, interval) RETURNS interval LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('double precision * interval', current_user::text);
		      RETURN $1 OPERATOR(pg_catalog.*) $2; END $$;
		CREATE OPERATOR public.* (LEFTARG = double precision, RIGHTARG = interval, FUNCTION = public.evil_mul);
		CREATE FUNCTION public.evil_fmul(double precision, double precision) RETURNS double precision LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('double precision * double precision', current_user::text);
		      RETURN $1 OPERATOR(pg_catalog.*) $2; END $$;
		CREATE OPERATOR public.* (LEFTARG = double precision, RIGHTARG = double precision, FUNCTION = public.evil_fmul);
		CREATE FUNCTION public.evil_teq(text, text) RETURNS boolean LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('text = text', current_user::text);
		      RETURN $1 OPERATOR(pg_catalog.=) $2; END $$;
		CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.evil_teq);
		CREATE FUNCTION public.floor(double precision) RETURNS double precision LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('floor(double precision)', current_user::text);
		      RETURN pg_catalog.floor($1); END $$;
		CREATE FUNCTION public.round(double precision) RETURNS double precision LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('round(double precision)', current_user::text);
		      RETURN pg_catalog.round($1); END $$;
		CREATE FUNCTION public.date_part(text, interval) RETURNS double precision LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.idem_fired (what, by_role) VALUES ('date_part(text, interval)', current_user::text);
		      RETURN pg_catalog.date_part($1, $2); END $$;
		RESET ROLE`); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"", "public, pg_catalog"} {
		for _, m := range []struct {
			name string
			mode pgx.QueryExecMode
		}{{"cache", 0}, {"exec", pgx.QueryExecModeExec}} {
			t.Run(fmt.Sprintf("%q/%s", path, m.name), func(t *testing.T) {
				set := ""
				if path != "" {
					set = `SET search_path = ` + path
				}
				source := fmt.Sprintf("other-%t-%s", path != "", m.name)
				countEvery(t, admin, source)
				c := testdb.Client(t, appPool(t, url, app, set, m.mode), &idem.Config{QueryExecMode: m.mode})
				exerciseClient(t, admin, c, source, "k", 1)
			})
		}
	}
	for _, f := range plant.Fired(t) {
		t.Errorf("the application's statements ran another role's look-alike: %s", f)
	}
}
