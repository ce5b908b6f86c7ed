package reliability

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

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
)

// asRole is a pool whose sessions run as role (SET ROLE: the privilege
// checks are those of role; it works on any server where the test user
// may create roles).
func asRole(t *testing.T, url, role string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET ROLE "+pgx.Identifier{role}.Sanitize())
		return err
	}
	p, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// newRole creates a NOLOGIN role unique to this test and drops it afterwards.
func newRole(t *testing.T, admin *pgxpool.Pool, name string) string {
	t.Helper()
	role := fmt.Sprintf("%s_%d", name, time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(context.Background(), "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" NOLOGIN"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		_, _ = admin.Exec(ctx, "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
		_, _ = admin.Exec(ctx, "DROP ROLE "+pgx.Identifier{role}.Sanitize())
	})
	return role
}

func refused(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "42501"
}

// TestLeastPrivilege: the application role can only run the protocol; the
// maintainer can prune, rotate and read, and neither can write the tables.
func TestLeastPrivilege(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 4)
	appRole := newRole(t, admin, "idem_app")
	maintRole := newRole(t, admin, `idem maint "quoted"`) // a hostile-looking name on purpose
	if _, err := admin.Exec(ctx, `SELECT idem.grant_app($1::text::regrole), idem.grant_maintainer($2::text::regrole)`,
		pgx.Identifier{appRole}.Sanitize(), pgx.Identifier{maintRole}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(-3)); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at)
		SELECT 'old', 'o' || g, $1::date, 'completed', g, $1::date, now(), now() - interval '1 day' FROM generate_series(1, 100) g`, monthStart(-3)); err != nil {
		t.Fatal(err)
	}

	t.Run("application role", func(t *testing.T) {
		app := asRole(t, url, appRole)
		c, err := idem.New(app, nil)
		if err != nil {
			t.Fatal(err)
		}
		cl, err := c.Claim(ctx, "stripe", "evt_priv")
		if err != nil || cl.Outcome != idem.Acquired {
			t.Fatalf("claim as the app role: %+v %v", cl, err)
		}
		if _, err := c.Extend(ctx, "stripe", "evt_priv", cl.Token, time.Minute); err != nil {
			t.Fatalf("extend: %v", err)
		}
		if err := c.Complete(ctx, "stripe", "evt_priv", cl.Token, []byte(`{"ok":1}`)); err != nil {
			t.Fatalf("complete: %v", err)
		}
		cl2, _ := c.Claim(ctx, "stripe", "evt_priv2")
		if err := c.Fail(ctx, "stripe", "evt_priv2", cl2.Token, "x", true); err != nil {
			t.Fatalf("fail: %v", err)
		}
		for _, sql := range []string{
			`SELECT * FROM idem.processed_events`,
			`DELETE FROM idem.processed_events`,
			`UPDATE idem.processed_events SET status = 'completed'`,
			`INSERT INTO idem.policies (source, ttl, lease) VALUES ('x', '1 day', '1 minute')`,
			`TRUNCATE idem.processed_events`,
			`SELECT idem.prune_batch('me', 10)`,
			`SELECT idem.create_partition(now()::date)`,
			`SELECT idem.retire_partition('idem.processed_events_default')`,
			`SELECT idem.try_lock('prune', 'me', '1 minute')`,
			`CALL idem.prune()`,
			`SELECT idem.grant_app(current_user::regrole)`,
		} {
			if _, err := app.Exec(ctx, sql); !refused(err) {
				t.Errorf("app role: %s: %v, want permission denied", sql, err)
			}
		}
	})
	t.Run("maintainer role", func(t *testing.T) {
		maint := asRole(t, url, maintRole)
		pr, err := prune.Run(ctx, maint, prune.Config{})
		if err != nil || pr.Deleted != 100 {
			t.Fatalf("prune as the maintainer: %+v %v", pr, err)
		}
		rr, err := partition.Rotate(ctx, maint, partition.Config{})
		if err != nil || !strings.Contains(fmt.Sprint(rr.Steps), "dropped") {
			t.Fatalf("rotate as the maintainer: %+v %v", rr, err)
		}
		var n int
		if err := maint.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events`).Scan(&n); err != nil {
			t.Fatalf("stats read as the maintainer: %v", err)
		}
		for _, sql := range []string{
			`DELETE FROM idem.processed_events`,
			`UPDATE idem.processed_events SET status = 'completed'`,
			`TRUNCATE idem.processed_events`,
			`SELECT * FROM idem.claim('s', 'k')`,
			`DROP TABLE idem.processed_events_default`,
		} {
			if _, err := maint.Exec(ctx, sql); !refused(err) {
				t.Errorf("maintainer: %s: %v, want permission denied", sql, err)
			}
		}
	})
}

// TestSearchPathHijack: look-alike objects early on the caller's search
// path are never used by the functions that run as idem's owner.
func TestSearchPathHijack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 4)
	appRole := newRole(t, admin, "idem_app_sp")
	if _, err := admin.Exec(ctx, `SELECT idem.grant_app($1::text::regrole)`, pgx.Identifier{appRole}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	evil := "evil_" + strings.ToLower(appRole)
	q := pgx.Identifier{evil}.Sanitize()
	if _, err := admin.Exec(ctx, fmt.Sprintf(`
		CREATE SCHEMA %[1]s;
		GRANT USAGE, CREATE ON SCHEMA %[1]s TO PUBLIC;
		CREATE TABLE %[1]s.processed_events (source text, key text);
		CREATE TABLE %[1]s.policies (source text);
		CREATE FUNCTION %[1]s.trap() RETURNS boolean LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'hijacked'; END $$;
		CREATE FUNCTION %[1]s.btrim(text, text) RETURNS text LANGUAGE sql AS 'SELECT CASE WHEN %[1]s.trap() THEN $1 END';
		CREATE FUNCTION %[1]s.octet_length(text) RETURNS integer LANGUAGE sql AS 'SELECT CASE WHEN %[1]s.trap() THEN 1 END';
		CREATE FUNCTION %[1]s.clock_timestamp() RETURNS timestamptz LANGUAGE sql AS 'SELECT CASE WHEN %[1]s.trap() THEN now() END';
		CREATE FUNCTION %[1]s.nextval(regclass) RETURNS bigint LANGUAGE sql AS 'SELECT CASE WHEN %[1]s.trap() THEN 1::bigint END';
		CREATE FUNCTION %[1]s.hashtext(text) RETURNS integer LANGUAGE sql AS 'SELECT CASE WHEN %[1]s.trap() THEN 1 END';
		CREATE FUNCTION %[1]s.texteq_always(text, text) RETURNS boolean LANGUAGE sql AS 'SELECT true';
		CREATE OPERATOR %[1]s.= (LEFTARG = text, RIGHTARG = text, FUNCTION = %[1]s.texteq_always);
		CREATE OPERATOR %[1]s.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = %[1]s.texteq_always);
	`, q)); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = evil + ", pg_catalog, idem"
	cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
		_, err := c.Exec(ctx, "SET ROLE "+pgx.Identifier{appRole}.Sanitize())
		return err
	}
	p, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	// The trap fires for the caller's own unqualified calls...
	if _, err := p.Exec(ctx, `SELECT btrim('x', 'y')`); err == nil || !strings.Contains(err.Error(), "hijacked") {
		t.Fatalf("the look-alike objects are not on the caller's path: %v", err)
	}
	// ...and never inside idem's functions, whose answers stay right.
	c, err := idem.New(p, nil)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := c.Claim(ctx, "stripe", "evt_sp", idem.WithFingerprint("a"))
	if err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("claim with a hostile search_path: %+v %v", cl, err)
	}
	if mm, err := c.Claim(ctx, "stripe", "evt_sp", idem.WithFingerprint("b")); err != nil || mm.Outcome != idem.Mismatch {
		t.Fatalf("a look-alike = would hide the mismatch: %+v %v", mm, err)
	}
	if _, err := c.Extend(ctx, "stripe", "evt_sp", cl.Token, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(ctx, "stripe", "evt_sp", cl.Token+1, nil); !errors.Is(err, idem.ErrStaleToken) {
		t.Fatalf("a look-alike = would accept any token: %v", err)
	}
	if err := c.Complete(ctx, "stripe", "evt_sp", cl.Token, []byte(`{"ok":true}`)); err != nil {
		t.Fatal(err)
	}
	// Every function that runs as its owner pins search_path.
	var unpinned []string
	rows, err := admin.Query(ctx, `SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname = 'idem' AND p.prosecdef
		  AND NOT EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c = 'search_path=pg_catalog, pg_temp')`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var f string
		_ = rows.Scan(&f)
		unpinned = append(unpinned, f)
	}
	if len(unpinned) > 0 {
		t.Fatalf("SECURITY DEFINER functions without a pinned search_path: %v", unpinned)
	}
}

// TestHostileSources: sources and keys that look like SQL are data.
func TestHostileSources(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{
		`x'); DROP TABLE idem.policies; --`,
		`"quoted" source`,
		`a;b`,
		`%s %I %L`,
		`back\slash`,
		`naïve ☕`,
		`idem.processed_events_default`,
	} {
		res, err := c.Do(ctx, src, `k'); DELETE FROM idem.processed_events; --`, func(context.Context) (any, error) { return src, nil })
		if err != nil || res.Replayed {
			t.Fatalf("%q: %+v %v", src, res, err)
		}
		again, err := c.Do(ctx, src, `k'); DELETE FROM idem.processed_events; --`, func(context.Context) (any, error) { return nil, nil })
		if err != nil || !again.Replayed {
			t.Fatalf("%q replay: %+v %v", src, again, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.processed_events`); n != 7 {
		t.Fatalf("%d rows, want 7", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM idem.policies`); n != 1 {
		t.Fatalf("policies damaged: %d rows", n)
	}
	if _, err := prune.Run(ctx, pool, prune.Config{}); err != nil {
		t.Fatal(err)
	}
	if _, err := partition.Rotate(ctx, pool, partition.Config{}); err != nil {
		t.Fatal(err)
	}
}

// TestTokenGuessing: fencing tokens are random, so knowing one key's token
// says nothing of another's. 50 keys claimed one after the other; 2,001
// guesses around the first key's token (a sequence would hand out the next
// ones) against each of the other 49 keys complete none of them.
func TestTokenGuessing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	var known int64
	for i := range 50 {
		cl, err := c.Claim(ctx, "guess", fmt.Sprintf("k%02d", i))
		if err != nil || cl.Outcome != idem.Acquired {
			t.Fatalf("claim: %+v %v", cl, err)
		}
		if i == 0 {
			known = cl.Token
		}
	}
	var completed int
	if err := pool.QueryRow(ctx, `
		SELECT count(*) FROM generate_series(-1000, 1000) g, idem.processed_events e
		 WHERE e.source = 'guess' AND e.key <> 'k00'
		   AND idem.complete(e.source, e.key, $1::bigint + g, '{"forged": true}') = 'completed'`, known).Scan(&completed); err != nil {
		t.Fatal(err)
	}
	if completed != 0 {
		t.Fatalf("%d keys completed by guessing tokens around a known one", completed)
	}
	if n := count(t, pool, `SELECT count(*)::int FROM idem.processed_events WHERE source = 'guess' AND status = 'processing'`); n != 50 {
		t.Fatalf("%d of 50 keys still processing", n)
	}
}
