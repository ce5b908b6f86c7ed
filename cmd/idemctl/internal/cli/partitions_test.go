package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/testdb"
)

func partitionNames(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	parts, err := partition.List(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, p := range parts {
		names = append(names, strings.TrimPrefix(p.Name, "idem.processed_events_"))
	}
	return names
}

func pname(m time.Time) string { return m.Format("p2006_01") }

func TestRotate(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	now := time.Now()
	// Three past months: one fully expired, one with a live row, one whose
	// rows landed in the default partition (no partition was made).
	for _, m := range []int{-3, -2} {
		if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(now, m)); err != nil {
			t.Fatal(err)
		}
	}
	seedRows(t, pool, "old-", monthStart(now, -3), 500, true, false)
	seedRows(t, pool, "gone-", monthStart(now, -2), 500, true, false)
	seedRows(t, pool, "keep-", monthStart(now, -2), 1, false, false)
	seedRows(t, pool, "stray-", monthStart(now, -1), 50, false, false) // lands in the default partition
	seedRows(t, pool, "far-", monthStart(now, 7), 5, false, false)     // a month far ahead: default too
	var inDefault int
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events_default`).Scan(&inDefault)
	if inDefault != 55 {
		t.Fatalf("%d rows in the default partition, want 55", inDefault)
	}

	r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--premake", "4")
	if r.code != 0 {
		t.Fatalf("rotate: %+v", r)
	}
	// The months whose rows are in the default partition get no partition:
	// the rows stay there (claims find them) until prune deletes them.
	want := []string{pname(monthStart(now, -2)), pname(monthStart(now, 0)),
		pname(monthStart(now, 1)), pname(monthStart(now, 2)), pname(monthStart(now, 3)), pname(monthStart(now, 4)), "default"}
	if got := partitionNames(t, pool); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("partitions after rotate:\n got %v\nwant %v\n%s", got, want, r.out)
	}
	for _, line := range []string{"retire  idem.processed_events_" + pname(monthStart(now, -3)) + " ",
		"dropped", "kept: it still has live rows", "create  " + monthStart(now, 4).Format("2006-01")} {
		if !strings.Contains(r.out, line) {
			t.Errorf("rotate output lacks %q:\n%s", line, r.out)
		}
	}
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events_default`).Scan(&inDefault)
	left := keysLeft(t, pool)
	if inDefault != 55 || left["stray"] != 50 || left["far"] != 5 || left["keep"] != 1 || left["gone"] != 500 || left["old"] != 0 {
		t.Fatalf("after rotate: %d in default, keys %v", inDefault, left)
	}

	t.Run("idempotent", func(t *testing.T) {
		r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--premake", "4")
		if r.code != 0 || strings.Contains(r.out, "created") || strings.Contains(r.out, "dropped") {
			t.Fatalf("second rotate changed something: %+v", r)
		}
		if got := partitionNames(t, pool); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("partitions changed: %v", got)
		}
	})
	t.Run("keep detached", func(t *testing.T) {
		if _, err := pool.Exec(ctx, `DELETE FROM idem.processed_events WHERE key = 'keep-1'`); err != nil {
			t.Fatal(err)
		}
		r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--premake", "4", "--keep-detached")
		if r.code != 0 || !strings.Contains(r.out, "detached") {
			t.Fatalf("rotate --keep-detached: %+v", r)
		}
		var archived int
		if err := pool.QueryRow(ctx, fmt.Sprintf(`SELECT count(*) FROM idem.processed_events_%s`, pname(monthStart(now, -2)))).Scan(&archived); err != nil || archived != 500 {
			t.Fatalf("detached table: %d rows, %v", archived, err)
		}
	})
	t.Run("list", func(t *testing.T) {
		r := idemctl(t, ctx, nil, "partitions", "list", "--database-url", url, "--json")
		if r.code != 0 || !strings.Contains(r.out, `"default": true`) {
			t.Fatalf("list: %+v", r)
		}
	})
	t.Run("from SQL", func(t *testing.T) {
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		if _, err := conn.Exec(ctx, `CALL idem.rotate(premake => 6)`); err != nil {
			t.Fatal(err)
		}
		if got := partitionNames(t, pool); !strings.Contains(fmt.Sprint(got), pname(monthStart(now, 6))) {
			t.Fatalf("CALL idem.rotate(6) did not premake 6 months: %v", got)
		}
		seedRows(t, pool, "sqlprune-", monthStart(now, 0), 1234, true, false)
		if _, err := conn.Exec(ctx, `CALL idem.prune(batch_size => 100)`); err != nil {
			t.Fatal(err)
		}
		if keysLeft(t, pool)["sqlprune"] != 0 {
			t.Fatal("CALL idem.prune() left expired rows")
		}
	})
}

// TestRotationGivesWayToALongTransaction: a session holds a long
// transaction on the table; rotation waits at most its lock timeout per
// try, retries, and gives up, while claims keep flowing.
func TestRotationGivesWayToALongTransaction(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 16)
	now := time.Now()
	if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(now, -2)); err != nil {
		t.Fatal(err)
	}
	seedRows(t, pool, "old-", monthStart(now, -2), 100, true, false) // retirable

	// The long transaction: a report reading the table, left open.
	long, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer long.Rollback(ctx)
	var n int
	if err := long.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events`).Scan(&n); err != nil {
		t.Fatal(err)
	}

	// Claims run throughout.
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var claims, failures atomic.Int64
	var wg sync.WaitGroup
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("w%d-%d", w, i)
				if _, err := c.Do(ctx, "load", key, func(context.Context) (any, error) { return 1, nil }); err != nil {
					failures.Add(1)
					t.Errorf("claim %s failed during rotation: %v", key, err)
					return
				}
				claims.Add(1)
			}
		}()
	}
	res, err := partition.Rotate(ctx, pool, partition.Config{LockTimeout: new(200 * time.Millisecond), Retries: new(2), Backoff: new(50 * time.Millisecond)})
	claimsDuringRotation := claims.Load()
	close(stop)
	wg.Wait()
	// Every step needs a lock the long transaction's AccessShare blocks
	// (creating a month locks the default partition; retiring locks the
	// table): each gives up after its tries instead of queueing claims.
	if !errors.Is(err, partition.ErrIncomplete) || res.GaveUp != len(res.Steps) || !strings.Contains(fmt.Sprint(res.Steps), "retire") {
		t.Fatalf("rotation against a long transaction: %+v, %v; want every step to give up", res, err)
	}
	if failures.Load() != 0 || claimsDuringRotation == 0 {
		t.Fatalf("%d claims during rotation, %d failed", claimsDuringRotation, failures.Load())
	}
	// Once the long transaction ends, the next rotation retires the month.
	_ = long.Rollback(ctx)
	res, err = partition.Rotate(ctx, pool, partition.Config{LockTimeout: new(time.Second)})
	if err != nil || !strings.Contains(fmt.Sprint(res.Steps), "dropped") {
		t.Fatalf("rotation after the long transaction: %+v %v", res, err)
	}
}

// TestMoveDefaultRows: claims landed in the default partition while the
// current month had no partition. rotate --move-default, run by the
// maintainer in a database with a non-ISO DateStyle and a non-UTC
// TimeZone while the application role claims new keys of the month and
// redelivers the stranded ones, moves them into the month's new partition:
// every key stays answered (each stranded key a duplicate, never acquired
// again), the default partition is left empty, and later claims land in
// the month. A month with more rows than --max-move-rows is left as it is.
func TestMoveDefaultRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, maintURL, app, admin := hostileDatabase(t)
	now := time.Now()
	if _, err := admin.Exec(ctx, `DROP TABLE idem.processed_events_`+pname(monthStart(now, 0))); err != nil {
		t.Fatal(err)
	}
	const stranded = 20_000
	seedRows(t, admin, "stray-", monthStart(now, 0), stranded, false, false)
	seedRows(t, admin, "far-", monthStart(now, 9), 30, false, false) // a month rotation does not premake

	appPool := testdb.Pool(t, testdb.AsUser(url, app), 8)
	stop := make(chan struct{})
	type tally struct {
		acquired map[string]int
		dupes    int
		worst    time.Duration
	}
	results := make(chan tally, 4)
	for w := range 4 {
		go func() {
			r := tally{acquired: map[string]int{}}
			defer func() { results <- r }()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				source, key := "stall", fmt.Sprintf("w%d-%d", w, i)
				if i%2 == 1 { // a redelivery of a stranded key
					source, key = "seed", fmt.Sprintf("stray-%d", 1+(w*7919+i*104729)%stranded)
				}
				start := time.Now()
				var outcome string
				if err := appPool.QueryRow(ctx, `SELECT outcome FROM idem.claim($1, $2)`, source, key).Scan(&outcome); err != nil {
					t.Errorf("claim %s/%s: %v", source, key, err)
					return
				}
				r.worst = max(r.worst, time.Since(start))
				switch {
				case outcome == "acquired":
					r.acquired[source+"/"+key]++
				case source == "seed":
					r.dupes++
				}
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", maintURL, "--move-default", "--lock-timeout", "2s")
	time.Sleep(300 * time.Millisecond)
	close(stop)
	acquired := map[string]int{}
	var dupes int
	var worst time.Duration
	for range 4 {
		res := <-results
		for k, n := range res.acquired {
			acquired[k] += n
		}
		dupes += res.dupes
		worst = max(worst, res.worst)
	}
	if r.code != 0 {
		t.Fatalf("rotate --move-default: %+v", r)
	}
	out := strings.Join(strings.Fields(r.out), " ")
	for _, want := range []string{"move " + monthStart(now, 0).Format("2006-01") + " moved ", "move " + monthStart(now, 9).Format("2006-01") + " moved 30 rows"} {
		if !strings.Contains(out, want) {
			t.Errorf("rotate's output lacks %q:\n%s", want, r.out)
		}
	}
	for k, n := range acquired {
		if strings.HasPrefix(k, "seed/") || n != 1 {
			t.Errorf("%s acquired %d times", k, n)
		}
	}
	if dupes == 0 {
		t.Fatal("no stranded key was redelivered during the test")
	}
	var inDefault, stray, stall, inMonth int
	if err := admin.QueryRow(ctx, `SELECT (SELECT count(*) FROM idem.processed_events_default),
		(SELECT count(*) FROM idem.processed_events WHERE key LIKE 'stray-%'),
		(SELECT count(*) FROM idem.processed_events WHERE source = 'stall'),
		(SELECT count(*) FROM idem.processed_events_`+pname(monthStart(now, 0))+`)`).Scan(&inDefault, &stray, &stall, &inMonth); err != nil {
		t.Fatal(err)
	}
	if inDefault != 0 || stray != stranded || stall != len(acquired) || inMonth != stranded+len(acquired) {
		t.Fatalf("after the move: %d rows in the default partition, %d stranded keys (want %d), %d new keys stored of %d acquired, %d in the month",
			inDefault, stray, stranded, stall, len(acquired), inMonth)
	}
	t.Logf("%d new keys and %d redeliveries during the move; longest claim %s (a bound of the stall, not a benchmark)", len(acquired), dupes, worst)

	// A month with more rows than the bound stays as it is, and says so.
	if _, err := admin.Exec(ctx, `DROP TABLE idem.processed_events_`+pname(monthStart(now, 1))); err != nil {
		t.Fatal(err)
	}
	seedRows(t, admin, "big-", monthStart(now, 1), 11, false, false)
	r = idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", maintURL, "--move-default", "--max-move-rows", "10")
	if r.code != 0 || !strings.Contains(r.out, "kept: 11 rows in the default partition, more than MaxMoveRows (10)") {
		t.Fatalf("rotate --move-default over the bound: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", maintURL, "--max-move-rows", "0"); r.code != ExitUsage || !strings.Contains(r.errout, "--max-move-rows 0 is out of range") {
		t.Fatalf("--max-move-rows 0: %+v", r)
	}
}
