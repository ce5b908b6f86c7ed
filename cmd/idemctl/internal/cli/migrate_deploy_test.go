package cli

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestMigrateUpRacingThroughPgBouncer: two idemctl migrate up processes at
// once through PgBouncer in transaction pooling mode (idemctl's documented
// connection): both exit 0, each of idem's steps and each of River's is
// applied once, no migration lock is left on a server session, and a
// direct migrate up afterwards is up to date at once.
func TestMigrateUpRacingThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.NewEmpty(t)
	direct := testdb.Pool(t, dsn, 2)
	var name string
	if err := direct.QueryRow(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	bouncer := testdb.PgBouncer(t, name) + testdb.ExecMode // as docs/idemctl.md says for PgBouncer before 1.21
	bin := binary(t)
	type run struct {
		out  string
		err  error
		took time.Duration
	}
	var (
		wg   sync.WaitGroup
		runs [2]run
	)
	for i := range runs {
		wg.Go(func() {
			cmd := exec.CommandContext(ctx, bin, "migrate", "up", "--database-url", bouncer)
			cmd.Env = os.Environ()
			var out bytes.Buffer
			cmd.Stdout, cmd.Stderr = &out, &out
			start := time.Now()
			err := cmd.Run()
			runs[i] = run{out.String(), err, time.Since(start)}
		})
	}
	wg.Wait()
	applied := 0
	river := 0
	for i, r := range runs {
		if r.err != nil {
			t.Fatalf("migrate up %d through PgBouncer failed: %v\n%s", i, r.err, r.out)
		}
		applied += strings.Count(r.out, "applied 000")
		river += strings.Count(r.out, "applied River migrations")
		t.Logf("migrate up %d (%v):\n%s", i, r.took.Round(time.Millisecond), r.out)
	}
	// The embedded migrations (a branch's may be numbered past a gap).
	steps, _ := fs.Glob(migrate.FS(), "*.sql")
	if applied != len(steps) {
		t.Errorf("the two processes applied %d of idem's steps, want each of %d once", applied, len(steps))
	}
	var rows, distinct, riverRows, riverDistinct, locks int
	if err := direct.QueryRow(ctx, `
		SELECT (SELECT count(*) FROM idem.goose_db_version WHERE version_id > 0),
		       (SELECT count(DISTINCT version_id) FROM idem.goose_db_version WHERE version_id > 0),
		       (SELECT count(*) FROM river_migration), (SELECT count(DISTINCT version) FROM river_migration),
		       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND database = (SELECT oid FROM pg_database WHERE datname = current_database()) AND classid = 0 AND objid IN ($1, $2) AND objsubid = 1)`,
		migrate.LockID, inbox.MigrateLockID).Scan(&rows, &distinct, &riverRows, &riverDistinct, &locks); err != nil {
		t.Fatal(err)
	}
	if rows != len(steps) || distinct != rows {
		t.Errorf("idem's version table: %d rows of %d versions, want %d", rows, distinct, len(steps))
	}
	if riverRows == 0 || riverDistinct != riverRows || river == 0 {
		t.Errorf("River's versions: %d rows of %d versions, %d processes said they applied some", riverRows, riverDistinct, river)
	}
	if locks != 0 {
		t.Errorf("%d migration locks left on server sessions", locks)
	}
	quick, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	r := idemctl(t, quick, map[string]string{"DATABASE_URL": dsn}, "migrate", "up")
	if r.code != 0 || !strings.Contains(r.out, "idem schema is up to date") || !strings.Contains(r.out, "River schema is up to date") {
		t.Fatalf("a direct migrate up after the race: %+v", r)
	}
}

// TestMigrateUpAsOwnerOnPG15: an owner role that is not a superuser and
// may create schemas in the database, but not in schema public (the
// default on PostgreSQL 15 and later), gets idem's steps applied and, from
// River's step, an error that says what to do; following it (a schema of
// its own for River) works.
func TestMigrateUpAsOwnerOnPG15(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.NewEmpty(t)
	admin := testdb.Pool(t, dsn, 2)
	var name string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&name); err != nil {
		t.Fatal(err)
	}
	owner := "owner_" + name
	if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE ROLE %[1]s LOGIN; GRANT CREATE ON DATABASE %[2]s TO %[1]s; REVOKE CREATE ON SCHEMA public FROM PUBLIC`,
		pgx.Identifier{owner}.Sanitize(), pgx.Identifier{name}.Sanitize())); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{owner}.Sanitize())
		_, _ = admin.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{owner}.Sanitize())
	})
	env := map[string]string{"DATABASE_URL": testdb.AsUser(dsn, owner)}
	r := idemctl(t, ctx, env, "migrate", "up")
	if r.code == 0 {
		t.Fatalf("migrate up as %s with no CREATE on public: exit 0\n%s", owner, r.out)
	}
	if !strings.Contains(r.out, "applied 00013_idem_claim_citus.sql") {
		t.Errorf("idem's steps were not applied before River's:\n%s", r.out)
	}
	for _, want := range []string{"may not CREATE", `schema "public"`, "--river-schema", "GRANT CREATE ON SCHEMA public TO " + owner, "--river=false", "permission denied for schema public"} {
		if !strings.Contains(r.errout, want) {
			t.Errorf("the error does not say %q:\n%s", want, r.errout)
		}
	}
	t.Logf("the error: %s", r.errout)
	ownerPool := testdb.Pool(t, testdb.AsUser(dsn, owner), 1)
	if _, err := ownerPool.Exec(ctx, "CREATE SCHEMA river AUTHORIZATION "+pgx.Identifier{owner}.Sanitize()); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, env, "migrate", "up", "--river-schema", "river"); r.code != 0 || !strings.Contains(r.out, "applied River migrations") {
		t.Fatalf("migrate up --river-schema river as %s: %+v", owner, r)
	}
}

// TestMigrateDownStatesTheLoss: idemctl migrate down across versions that
// hold state (an inbox hold, the maintenance runs' history) is refused
// with exit 1, on one line naming each table, and rolls nothing back;
// --force confirms it.
func TestMigrateDownStatesTheLoss(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": dsn}
	if r := idemctl(t, ctx, env, "migrate", "up", "--river=false"); r.code != 0 {
		t.Fatalf("migrate up: %+v", r)
	}
	pool := testdb.Pool(t, dsn, 1)
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.holds (source, key, token, held_at) VALUES ('s', 'k', 1, now());
		INSERT INTO idem.runs (job, started_at, finished_at, outcome, run_by) VALUES ('prune', now(), now(), 'ok', 'me')`); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, env, "migrate", "down", "--to", "6")
	if r.code != ExitError {
		t.Fatalf("down --to 6 holding state: %+v", r)
	}
	oneLine(t, r.errout, "idem.runs: 1 rows (dropped by migration 10's Down); idem.holds: 1 rows (dropped by migration 7's Down); pass force (idemctl migrate down --force)")
	if r := idemctl(t, ctx, env, "migrate", "version"); r.code != 0 || strings.TrimSpace(r.out) != fmt.Sprint(migrate.Latest()) {
		t.Fatalf("after the refusal: %+v, want version %d", r, migrate.Latest())
	}
	if r := idemctl(t, ctx, env, "migrate", "down", "--to", "6", "--force"); r.code != 0 || !strings.Contains(r.out, "rolled back 00007_idem_inbox_holds.sql") {
		t.Fatalf("down --to 6 --force: %+v", r)
	}
}
