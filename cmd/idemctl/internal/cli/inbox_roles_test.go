package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestInboxRoles: least privilege with the inbox, in the order a team
// meets it: idem is migrated without River, the roles are granted, and
// River's tables come later with migrate up, which gives the roles their
// rights there. The web side (accept) and the worker run as the
// application role; stats, inbox list and inbox replay as the maintainer
// role. The reconciliation adds up, read by the maintainer.
func TestInboxRoles(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.NewEmpty(t)
	admin := testdb.Pool(t, dsn, 4)
	env := map[string]string{"DATABASE_URL": dsn}
	if r := idemctl(t, ctx, env, "migrate", "up", "--river=false"); r.code != 0 {
		t.Fatalf("migrate up --river=false: %d\n%s%s", r.code, r.out, r.errout)
	}
	suffix := fmt.Sprint(time.Now().UnixNano() % 1e9)
	app, ops := "inbox_app_"+suffix, "inbox_ops_"+suffix
	for _, role := range []string{app, ops} {
		if _, err := admin.Exec(ctx, "CREATE ROLE "+pgx.Identifier{role}.Sanitize()+" LOGIN"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_, _ = admin.Exec(context.Background(), "DROP OWNED BY "+pgx.Identifier{role}.Sanitize())
			_, _ = admin.Exec(context.Background(), "DROP ROLE "+pgx.Identifier{role}.Sanitize())
		})
	}
	if r := idemctl(t, ctx, env, "grant", "--app", app, "--maintainer", ops); r.code != 0 {
		t.Fatalf("grant: %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 || !strings.Contains(r.out, "applied River migrations") {
		t.Fatalf("migrate up with River: %d\n%s%s", r.code, r.out, r.errout)
	}
	if _, err := admin.Exec(ctx, `CREATE TABLE processed (key text PRIMARY KEY); GRANT INSERT ON processed TO `+pgx.Identifier{app}.Sanitize()); err != nil {
		t.Fatal(err)
	}

	// Web and worker as the application role.
	appPool := testdb.Pool(t, testdb.AsUser(dsn, app), 8)
	var fixed atomic.Bool
	in, err := inbox.New(inbox.Config{Pool: appPool, MaxAttempts: map[string]int{"shop": 1}, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		if d.Key == "order-bad" && !fixed.Load() {
			return nil, errors.New("no such product")
		}
		_, err := tx.Exec(ctx, `INSERT INTO processed (key) VALUES ($1)`, d.Key)
		return nil, err
	}})
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"order-1", "order-2", "order-bad"} {
		if a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: key, Payload: []byte(`{}`)}); err != nil || a.Duplicate {
			t.Fatalf("accept %s as the app role: %+v %v", key, a, err)
		}
	}
	rc, err := in.NewWorkerClient(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rc.Stop(context.WithoutCancel(ctx))
	count := func(sql string) (n int) {
		if err := admin.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	wait := func(what string, cond func() bool) {
		for deadline := time.Now().Add(60 * time.Second); !cond(); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	wait("two processed, one dead letter", func() bool {
		d, _ := in.DeadLetters(ctx, inbox.Filter{})
		return count(`SELECT count(*) FROM processed`) == 2 && len(d) == 1
	})

	// The inbox commands as the maintainer role.
	opsEnv := map[string]string{"DATABASE_URL": testdb.AsUser(dsn, ops)}
	if r := idemctl(t, ctx, opsEnv, "stats"); r.code != 0 || !regexpLine(r.out, `^shop\s+3\s+2\s+1\s+0\s+0\s+0\s+0\s+true\s*$`) || strings.Contains(r.out, "inbox:") {
		t.Fatalf("stats as the maintainer: %d\n%s%s", r.code, r.out, r.errout)
	}
	if r := idemctl(t, ctx, opsEnv, "inbox", "list"); r.code != 0 || !strings.Contains(r.out, "order-bad") || !strings.Contains(r.out, "no such product") {
		t.Fatalf("inbox list as the maintainer: %d\n%s%s", r.code, r.out, r.errout)
	}
	fixed.Store(true)
	if r := idemctl(t, ctx, opsEnv, "inbox", "replay", "--source", "shop"); r.code != 0 || !strings.HasPrefix(r.out, "replayed shop/order-bad") {
		t.Fatalf("inbox replay as the maintainer: %d\n%s%s", r.code, r.out, r.errout)
	}
	wait("the replay processed", func() bool { return count(`SELECT count(*) FROM processed`) == 3 })
	if r := idemctl(t, ctx, opsEnv, "stats", "--json"); r.code != 0 || !strings.Contains(r.out, `"accepted": 3`) || !strings.Contains(r.out, `"processed": 3`) {
		t.Fatalf("stats --json as the maintainer: %d\n%s%s", r.code, r.out, r.errout)
	}
	// Neither role can do what the other does.
	ops1 := testdb.Pool(t, testdb.AsUser(dsn, ops), 1)
	if _, err := ops1.Exec(ctx, `SELECT * FROM idem.claim('shop', 'x')`); err == nil {
		t.Error("the maintainer claimed a key")
	}
	if _, err := appPool.Exec(ctx, `CALL idem.prune()`); err == nil {
		t.Error("the app role pruned")
	}
}

// TestCheckInboxReconciliation: check is healthy while every accepted
// event is accounted for, and fails (exit 5) naming the source when one is
// queued with no job that will run it (its job deleted by hand); Repair
// dead-letters it (the payload went with the job) and check is healthy
// again, the event now a dead letter with that reason.
func TestCheckInboxReconciliation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": dsn}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 {
		t.Fatalf("migrate up: %d\n%s%s", r.code, r.out, r.errout)
	}
	pool := testdb.Pool(t, dsn, 4)
	in, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order-9", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, env, "check", "--json"); r.code != 0 || !strings.Contains(r.out, `"accepted": 1`) {
		t.Fatalf("check with one queued event: %d\n%s%s", r.code, r.out, r.errout)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM river_job WHERE id = $1`, a.JobID); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, env, "check"); r.code != ExitUnhealthy || !strings.Contains(r.errout, "inbox shop: 1 accepted events have no job that will run them") {
		t.Fatalf("check with a lost job: %d\n%s%s", r.code, r.out, r.errout)
	}
	rep, err := in.Repair(ctx)
	if err != nil || rep.DeadLettered != 1 {
		t.Fatalf("repair: %+v %v", rep, err)
	}
	// The installation is healthy again, and the dead letter is named with
	// its own exit code (7): an event an operator must look at.
	if r := idemctl(t, ctx, env, "check"); r.code != ExitDeadLetters || !strings.Contains(r.errout, "attention: inbox shop: 1 dead letter, the oldest since ") ||
		!strings.Contains(r.errout, `(order-9): `+"`idemctl inbox list --source shop`") {
		t.Fatalf("check after the repair: %d\n%s%s", r.code, r.out, r.errout)
	}
	dead, err := in.DeadLetters(ctx, inbox.Filter{})
	if err != nil || len(dead) != 1 || !dead[0].PayloadLost || !strings.Contains(dead[0].LastError, "gone") {
		t.Fatalf("dead letters %+v %v", dead, err)
	}
	// Left as it is, with its reason counted: exit 8 (ExitLeft).
	if r := idemctl(t, ctx, env, "inbox", "replay", "--source", "shop"); r.code != ExitLeft || !strings.Contains(r.out, "payload lost") ||
		!strings.Contains(r.out, "1 dead letter(s): payload lost 1") {
		t.Fatalf("replay of a lost payload: %d\n%s%s", r.code, r.out, r.errout)
	}
}
