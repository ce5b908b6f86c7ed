package cli

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
)

// dropFutureMonths drops the (empty) partitions after the current month.
func dropFutureMonths(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	_, err := pool.Exec(context.Background(), `
		DO $$ DECLARE p regclass; BEGIN
		  FOR p IN SELECT m.partition FROM idem.partition_months() m
		            WHERE m.month_from > idem.utc_month(idem.clock()) LOOP
		    EXECUTE format('DROP TABLE %s', p);
		  END LOOP; END $$`)
	if err != nil {
		t.Fatal(err)
	}
}

// TestZeroIsHonoured: a zero given on the command line means zero, as in
// CALL idem.rotate(premake => 0); only a flag not given means the default.
func TestZeroIsHonoured(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	t.Run("premake 0", func(t *testing.T) {
		t.Parallel()
		url := testdb.New(t)
		pool := testdb.Pool(t, url, 2)
		dropFutureMonths(t, pool)
		before := partitionNames(t, pool)
		if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--premake", "0"); r.code != 0 {
			t.Fatalf("rotate --premake 0: %+v", r)
		}
		if got := partitionNames(t, pool); fmt.Sprint(got) != fmt.Sprint(before) {
			t.Fatalf("--premake 0 made partitions: %v -> %v", before, got)
		}
		// The same through SQL, then the default (3) through both.
		if _, err := pool.Exec(ctx, `CALL idem.rotate(premake => 0)`); err != nil {
			t.Fatal(err)
		}
		if got := partitionNames(t, pool); fmt.Sprint(got) != fmt.Sprint(before) {
			t.Fatalf("CALL idem.rotate(premake => 0) made partitions: %v -> %v", before, got)
		}
		if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url); r.code != 0 {
			t.Fatalf("rotate: %+v", r)
		}
		goDefault := partitionNames(t, pool)
		if len(goDefault) != len(before)+partition.DefaultPremake {
			t.Fatalf("rotate without --premake: %v -> %v, want %d more", before, goDefault, partition.DefaultPremake)
		}
		dropFutureMonths(t, pool)
		if _, err := pool.Exec(ctx, `CALL idem.rotate()`); err != nil {
			t.Fatal(err)
		}
		if got := partitionNames(t, pool); fmt.Sprint(got) != fmt.Sprint(goDefault) {
			t.Fatalf("CALL idem.rotate() made %v, idemctl %v", got, goDefault)
		}
	})
	t.Run("retries 0", func(t *testing.T) {
		t.Parallel()
		url := testdb.New(t)
		pool := testdb.Pool(t, url, 4)
		dropFutureMonths(t, pool)
		// A transaction reading the table blocks creating a month (which
		// locks the default partition).
		long, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer long.Rollback(ctx)
		if _, err := long.Exec(ctx, `SELECT count(*) FROM idem.processed_events`); err != nil {
			t.Fatal(err)
		}
		r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url, "--premake", "1",
			"--retries", "0", "--backoff", "0", "--lock-timeout", "100ms")
		if r.code != ExitError || !strings.Contains(r.out, "after 1 tries") {
			t.Fatalf("rotate --retries 0: %+v", r)
		}
	})
	t.Run("sleep 0", func(t *testing.T) {
		t.Parallel()
		url, pool, want := threeMonths(t)
		r := idemctl(t, ctx, nil, "prune", "--database-url", url, "--batch-size", "100", "--sleep", "0")
		if r.code != 0 || !strings.Contains(r.out, "deleted 12,000 expired rows in 121 batches") {
			t.Fatalf("prune --sleep 0: %+v", r)
		}
		sameCounts(t, keysLeft(t, pool), want)
	})
}

// TestLockTimeoutIsNotLockLost: a prune batch that times out behind a
// table lock (SQLSTATE 55P03) is retried, and reported as a lock timeout
// when it keeps timing out, never as a lost prune lock (idem's own ID001).
func TestLockTimeoutIsNotLockLost(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool, want := threeMonths(t)
	hold := func() func() {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `LOCK TABLE idem.processed_events IN ACCESS EXCLUSIVE MODE`); err != nil {
			t.Fatal(err)
		}
		return func() { _ = tx.Rollback(ctx) }
	}
	release := hold()
	_, err := prune.Run(ctx, pool, prune.Config{LockTimeout: new(50 * time.Millisecond), Retries: new(2), Sleep: new(10 * time.Millisecond)})
	release()
	if !errors.Is(err, prune.ErrLockTimeout) || errors.Is(err, prune.ErrLockLost) {
		t.Fatalf("prune behind a table lock: %v, want ErrLockTimeout", err)
	}
	// Released during the retries: the run goes on and finishes.
	release = hold()
	go func() { time.Sleep(300 * time.Millisecond); release() }()
	res, err := prune.Run(ctx, pool, prune.Config{LockTimeout: new(100 * time.Millisecond), Retries: new(10), Sleep: new(50 * time.Millisecond)})
	if err != nil || res.Deleted != 12000 {
		t.Fatalf("prune with the lock released during its retries: %+v %v", res, err)
	}
	sameCounts(t, keysLeft(t, pool), want)

	// The lock really lost: another holder took it (its lease lapsed).
	const holder = "test-holder"
	if _, err := pool.Exec(ctx, `SELECT idem.try_lock('prune', $1, interval '1 hour')`, holder); err != nil {
		t.Fatal(err)
	}
	_, err = pool.Exec(ctx, `SELECT idem.prune_batch('someone-else', 10)`)
	if err == nil || !strings.Contains(err.Error(), "ID001") {
		t.Fatalf("prune_batch without the lock: %v, want SQLSTATE ID001", err)
	}
	r := idemctl(t, ctx, nil, "prune", "--database-url", url, "--fail-if-locked")
	if r.code != ExitLocked {
		t.Fatalf("prune while another holds the lock: %+v", r)
	}
}

// TestPruneCompactsDuplicateCounts: duplicate counts written from many
// backends (one row per source and backend) are folded into one row per
// source by both idemctl prune and CALL idem.prune(), totals unchanged.
func TestPruneCompactsDuplicateCounts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	seed := func() {
		_, err := pool.Exec(ctx, `
			INSERT INTO idem.duplicate_counts (source, slot, duplicates, since, last_seen_at)
			SELECT s, g, 10, now() - interval '1 day', now() FROM unnest(ARRAY['stripe', 'github']) s, generate_series(1, 40) g
			ON CONFLICT (source, slot) DO UPDATE SET duplicates = idem.duplicate_counts.duplicates + 10`)
		if err != nil {
			t.Fatal(err)
		}
	}
	check := func(how string, total int) {
		t.Helper()
		var rows, sum int
		if err := pool.QueryRow(ctx, `SELECT count(*), sum(duplicates) FROM idem.duplicate_counts`).Scan(&rows, &sum); err != nil {
			t.Fatal(err)
		}
		if rows != 2 || sum != total {
			t.Fatalf("after %s: %d rows summing to %d, want 2 rows summing to %d", how, rows, sum, total)
		}
	}
	seed()
	if r := idemctl(t, ctx, nil, "prune", "--database-url", url); r.code != 0 {
		t.Fatalf("prune: %+v", r)
	}
	check("idemctl prune", 800)
	seed()
	if _, err := pool.Exec(ctx, `CALL idem.prune()`); err != nil {
		t.Fatal(err)
	}
	check("CALL idem.prune()", 1600)
}

// TestSQLRotateSkipsALockedMonth: CALL idem.rotate() retires one past
// month, then times out locking the next (a session is reading it). The
// timed-out month is left attached for the next run, the procedure ends
// normally and releases the rotate lock. (Before version 4 the previous
// month's result was reused: drop_detached ran on the attached month and
// the procedure aborted holding the lock.)
func TestSQLRotateSkipsALockedMonth(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	now := time.Now()
	for _, m := range []int{-3, -2} {
		if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, monthStart(now, m)); err != nil {
			t.Fatal(err)
		}
		seedRows(t, pool, fmt.Sprintf("m%d-", -m), monthStart(now, m), 10, true, false)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM idem.processed_events WHERE first_seen_month < idem.utc_month(now())`); err != nil {
		t.Fatal(err)
	}
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer reader.Rollback(ctx)
	locked := "processed_events_" + pname(monthStart(now, -2))
	if _, err := reader.Exec(ctx, `SELECT count(*) FROM idem.`+locked); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CALL idem.rotate(lock_wait => '200 milliseconds')`); err != nil {
		t.Fatalf("CALL idem.rotate() with a month locked: %v", err)
	}
	names := fmt.Sprint(partitionNames(t, pool))
	if strings.Contains(names, pname(monthStart(now, -3))) || !strings.Contains(names, pname(monthStart(now, -2))) {
		t.Fatalf("partitions after rotation: %s; want %s retired and %s kept for the next run",
			names, pname(monthStart(now, -3)), pname(monthStart(now, -2)))
	}
	var got bool
	if err := pool.QueryRow(ctx, `SELECT acquired FROM idem.try_lock('rotate', 'next-run', NULL)`).Scan(&got); err != nil || !got {
		t.Fatalf("the rotate lock after the procedure: acquired %v, %v", got, err)
	}
	_ = reader.Rollback(ctx)
	if _, err := pool.Exec(ctx, `SELECT idem.release_lock('rotate', 'next-run')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CALL idem.rotate()`); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(fmt.Sprint(partitionNames(t, pool)), pname(monthStart(now, -2))) {
		t.Fatal("the next run did not retire the month that was locked")
	}
}
