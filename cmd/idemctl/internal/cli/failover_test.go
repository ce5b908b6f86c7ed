package cli

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/testdb"
)

// TestCheckAfterFailover: a primary with two keys in flight (claimed, not
// completed), a completed one and an event queued in the inbox is lost
// and its streaming replica promoted. check on the new primary names the
// two keys whose lease is from before the promotion, with the promotion's
// time and timeline (exit 7: nothing is broken, but their work may have
// run and its completion been lost); the completed key, the queued
// event, and a key claimed after the promotion are not named. A key
// completed since drops out. On a server never promoted there is no
// failover section. The claims, the backup and the promotion fall in the
// same second here more often than not: the promotion's time is known to
// the second, and keys of that second are named.
func TestCheckAfterFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Stop)
	env := map[string]string{"DATABASE_URL": primary.URL("postgres")}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 {
		t.Fatalf("migrate up: %d\n%s%s", r.code, r.out, r.errout)
	}
	pool := testdb.Pool(t, primary.URL("postgres"), 4)
	if _, err := inbox.Migrate(ctx, pool, ""); err != nil {
		t.Fatal(err)
	}
	c := testdb.Client(t, pool, nil)
	var inFlight []*idem.Claim
	for _, k := range []string{"evt_1", "evt_2"} {
		cl, err := c.Claim(ctx, "stripe", k)
		if err != nil || cl.Outcome != idem.Acquired {
			t.Fatalf("claim %s: %+v %v", k, cl, err)
		}
		inFlight = append(inFlight, cl)
	}
	if _, err := c.Do(ctx, "stripe", "evt_done", func(context.Context) (any, error) { return 1, nil }); err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(inbox.Config{Pool: pool, Idem: c})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order-1", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, env, "check", "--json"); r.code != 0 || strings.Contains(r.out, `"failover"`) {
		t.Fatalf("check before any promotion: %d\n%s%s", r.code, r.out, r.errout)
	}

	standby, err := primary.Standby(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Stop)
	pool.Close()
	primary.Crash()
	before := time.Now()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}

	env = map[string]string{"DATABASE_URL": standby.URL("postgres")}
	r := idemctl(t, ctx, env, "check")
	if r.code != ExitDeadLetters || !strings.Contains(r.errout, "attention: 2 keys in processing since before this server's promotion at ") ||
		!strings.Contains(r.errout, "(timeline 2): stripe/evt_1 (lease until ") || !strings.Contains(r.errout, "stripe/evt_2 (lease until ") ||
		strings.Contains(r.errout, "evt_done") || strings.Contains(r.errout, "order-1") {
		t.Fatalf("check on the promoted standby: %d\n%s%s", r.code, r.out, r.errout)
	}

	// A key claimed after the promotion is not from before it; a key
	// completed since is no longer in flight.
	npool := testdb.Pool(t, standby.URL("postgres"), 4)
	var promoted time.Time
	if err := npool.QueryRow(ctx, `SELECT modification FROM pg_ls_waldir() WHERE name = '00000002.history'`).Scan(&promoted); err != nil {
		t.Fatal(err)
	}
	if d := promoted.Sub(before); d < -time.Second || d > time.Minute {
		t.Fatalf("the promotion's time %v is not the promotion (requested at %v)", promoted, before)
	}
	// The promotion's time is known to the second: a key claimed within
	// that second may be from before it, and is named. evt_after waits
	// for the next second.
	time.Sleep(time.Until(promoted.Add(time.Second + 50*time.Millisecond)))
	nc := testdb.Client(t, npool, nil)
	if cl, err := nc.Claim(ctx, "stripe", "evt_after"); err != nil || cl.Outcome != idem.Acquired {
		t.Fatalf("claim after the promotion: %+v %v", cl, err)
	}
	if err := nc.Complete(ctx, "stripe", "evt_1", inFlight[0].Token, nil); err != nil {
		t.Fatalf("complete with the lease granted by the old primary: %v", err)
	}
	r = idemctl(t, ctx, env, "check", "--json")
	if r.code != ExitDeadLetters || !strings.Contains(r.out, `"processing_from_before": 1`) || !strings.Contains(r.out, `"timeline": 2`) ||
		!strings.Contains(r.out, `"key": "evt_2",`) || !strings.Contains(r.out, `"lease_until": `) || strings.Contains(r.out, `"key": "evt_after"`) {
		t.Fatalf("check --json after one completion: %d\n%s%s", r.code, r.out, r.errout)
	}
	if err := nc.Complete(ctx, "stripe", "evt_2", inFlight[1].Token, nil); err != nil {
		t.Fatal(err)
	}
	if r := idemctl(t, ctx, env, "check"); r.code != 0 {
		t.Fatalf("check with nothing left from before the promotion: %d\n%s%s", r.code, r.out, r.errout)
	}
}

// TestRunAcrossFailover: `idemctl run` connected through a multi-host
// connection string (target_session_attrs=read-write) goes on across a
// failover: its primary is lost mid-schedule, the standby promoted, and
// its next prune and rotation run on the new primary (recorded there in
// idem.runs), their maintenance locks taken or renewed by the same
// process; it exits 0 when its context ends.
func TestRunAcrossFailover(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	primary, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(primary.Stop)
	standby, err := primary.Standby(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(standby.Stop)
	url := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=postgres dbname=postgres sslmode=disable target_session_attrs=read-write connect_timeout=2",
		primary.Port, standby.Port)
	if r := idemctl(t, ctx, map[string]string{"DATABASE_URL": url}, "migrate", "up"); r.code != 0 {
		t.Fatalf("migrate up: %d\n%s%s", r.code, r.out, r.errout)
	}
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	addr := freeAddr(t)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr,
			"--prune-schedule", "@every 1s", "--rotate-schedule", "@every 1s", "--sleep", "1ms"},
			&out, &errw, func(string) string { return "" })
	}()
	// runsSince counts the ok runs of job recorded on c since at.
	runsSince := func(c *pgcluster.Cluster, job string, at time.Time) int {
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM idem.runs WHERE job = $1 AND outcome = 'ok' AND started_at > $2`, job, at).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitRuns := func(c *pgcluster.Cluster, at time.Time) {
		t.Helper()
		for deadline := time.Now().Add(60 * time.Second); runsSince(c, "prune", at) < 2 || runsSince(c, "rotate", at) < 2; time.Sleep(100 * time.Millisecond) {
			select {
			case n := <-code:
				t.Fatalf("idemctl run exited with %d: %s", n, errw.String())
			default:
			}
			if time.Now().After(deadline) {
				t.Fatalf("no prune and rotation recorded on port %d since %v within 60 s:\n%s", c.Port, at, errw.String())
			}
		}
	}
	waitRuns(primary, time.Time{})
	primary.Crash()
	if err := standby.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	var promoted time.Time
	conn, err := pgx.Connect(ctx, standby.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	err = conn.QueryRow(ctx, `SELECT modification FROM pg_ls_waldir() WHERE name = '00000002.history'`).Scan(&promoted)
	conn.Close(ctx)
	if err != nil {
		t.Fatal(err)
	}
	waitRuns(standby, promoted)
	cancel()
	select {
	case n := <-code:
		if n != 0 {
			t.Fatalf("exit %d after shutdown: %s", n, errw.String())
		}
	case <-time.After(10 * time.Second):
		t.Fatal("idemctl run did not stop within 10 s of its context ending")
	}
}
