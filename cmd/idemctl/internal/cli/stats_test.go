package cli

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

func TestStats(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Count every duplicate for the exact numbers below (default: 1 in 8).
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('stripe', '30 days', '2 minutes', 1)`); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		key := string(rune('a' + i))
		_, _ = c.Do(ctx, "stripe", key, func(context.Context) (any, error) { return 1, nil })
		for range 3 { // three duplicates of each
			_, _ = c.Do(ctx, "stripe", key, func(context.Context) (any, error) { return 1, nil })
		}
	}
	// Work that ran but whose result could not be stored.
	if _, err := c.Do(ctx, "big", "huge", func(context.Context) (any, error) {
		return map[string]string{"blob": strings.Repeat("x", 2<<20)}, nil
	}); !errors.Is(err, idem.ErrResultNotStored) {
		t.Fatalf("unstorable result: %v", err)
	}
	// Duplicates at the default sampling, 1 in 8, far below the rate
	// where claims are sampled (600 a minute): counted exactly, printed
	// exactly (before migration 19: a multiple of 8, printed "~").
	for range 17 {
		_, _ = c.Do(ctx, "sampled", "k", func(context.Context) (any, error) { return 1, nil })
	}
	// Two failures released for a retry, one for good.
	for _, k := range []string{"r1", "r2"} {
		_, _ = c.Do(ctx, "shopify", k, func(context.Context) (any, error) { return nil, errors.New("try again") })
	}
	_, _ = c.Do(ctx, "shopify", "p1", func(context.Context) (any, error) { return nil, idem.Permanent(errors.New("bad event")) })
	_, _ = c.Claim(ctx, "github", "stuck", idem.WithLease(time.Second))
	_, _ = c.Claim(ctx, "github", "busy")
	time.Sleep(1100 * time.Millisecond)

	r := idemctl(t, ctx, nil, "stats", "--database-url", url, "--json")
	if r.code != 0 {
		t.Fatalf("stats: %+v", r)
	}
	var out statsOut
	if err := json.Unmarshal([]byte(r.out), &out); err != nil {
		t.Fatal(err)
	}
	by := map[string]sourceStats{}
	for _, s := range out.Sources {
		by[s.Source] = s
	}
	st := by["stripe"]
	if st.Keys != 10 || st.Completed != 10 || st.Duplicates != 30 || st.DuplicateRate != 0.75 || st.DuplicateSampling != 1 {
		t.Errorf("stripe stats: %+v", st)
	}
	if s := by["sampled"]; s.DuplicateSampling != 8 || s.Duplicates != 16 || s.DuplicatesSampled {
		t.Errorf("duplicates below the sampling rate: %+v, want exactly 16, not sampled, duplicate_sampling 8", s)
	}
	gh := by["github"]
	if gh.Keys != 2 || gh.Processing != 2 || gh.Stuck != 1 {
		t.Errorf("github stats: %+v", gh)
	}
	if b := by["big"]; b.Keys != 1 || b.Completed != 1 || b.Unstored != 1 {
		t.Errorf("a key completed without its result: %+v", b)
	}
	if s := by["shopify"]; s.Keys != 3 || s.Released != 2 || s.Failed != 1 {
		t.Errorf("failures: %+v, want 2 released for a retry and 1 failed for good", s)
	}
	if len(out.Partitions) < 3 {
		t.Errorf("partitions: %+v", out.Partitions)
	}
	// No partition has been analyzed yet: its rows are counted, not shown
	// as 0 (reltuples is -1 until the first ANALYZE).
	var rows int64
	for _, p := range out.Partitions {
		rows += p.EstRows
	}
	if rows != 17 {
		t.Errorf("rows over the partitions before ANALYZE: %d, want the 17 stored", rows)
	}
	r = idemctl(t, ctx, nil, "stats", "--database-url", url)
	if r.code != 0 || !strings.Contains(r.out, "75.0%") || !strings.Contains(r.out, "processed_events_default") || !strings.Contains(r.out, "NO RESULT") || !strings.Contains(r.out, "RETRY") {
		t.Fatalf("stats table:\n%s", r.out)
	}
	if strings.Contains(r.out+r.errout, "password") {
		t.Fatal("stats printed a password")
	}
	for _, line := range strings.Split(r.out, "\n") {
		if strings.HasPrefix(line, "sampled ") && (!strings.Contains(line, " 16 ") || strings.Contains(line, "~")) {
			t.Errorf("duplicates below the sampling rate not printed exactly: %q", line)
		}
		if strings.HasPrefix(line, "stripe ") && (!strings.Contains(line, " 30 ") || strings.Contains(line, "~")) {
			t.Errorf("exact duplicates not printed exactly: %q", line)
		}
	}
}

func TestCheck(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 4)

	// A fresh install is healthy: the migrations premake what rotation would.
	r := idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != 0 || !strings.HasPrefix(r.out, "healthy: 3 months premade") {
		t.Fatalf("check on a fresh install: %+v", r)
	}
	// Missing months are reported and rotation makes them.
	if _, err := pool.Exec(ctx, `DROP TABLE idem.processed_events_p`+monthStart(time.Now(), 2).Format("2006_01")); err != nil {
		t.Fatal(err)
	}
	r = idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != ExitUnhealthy {
		t.Fatalf("check with a month missing: %+v", r)
	}
	oneLine(t, r.errout, "only 1 months after this one have a partition, want 2: run `idemctl partitions rotate`")
	if r := idemctl(t, ctx, nil, "partitions", "rotate", "--database-url", url); r.code != 0 {
		t.Fatal(r)
	}
	r = idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != 0 || !strings.HasPrefix(r.out, "healthy: 3 months premade") {
		t.Fatalf("check after rotate: %+v", r)
	}

	// Every problem at once.
	seedRows(t, pool, "stray-", monthStart(time.Now(), 9), 3, false, false) // default partition
	seedRows(t, pool, "exp-", monthStart(time.Now(), 0), 20, true, false)   // expired backlog
	if _, err := pool.Exec(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
		VALUES ('s', 'stuck', date_trunc('month', now())::date, 'processing', 1, now() - interval '1 hour', now() - interval '2 hours', now(), now() + interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	r = idemctl(t, ctx, nil, "check", "--database-url", url, "--max-expired", "10")
	if r.code != ExitUnhealthy {
		t.Fatalf("check: %+v", r)
	}
	// Rows in the default partition are no problem of their own: they stay
	// there until prune deletes them (no rotation can move them).
	// The stuck key is named, with when its lease ended.
	for _, want := range []string{"20 expired rows wait for prune (threshold 10)", "1 key stuck in processing more than 10m0s past its lease (threshold 0): s/stuck (lease ended 20"} {
		if !strings.Contains(r.errout, want) {
			t.Errorf("check output lacks %q:\n%s", want, r.errout)
		}
	}
	oneLine(t, r.errout, "unhealthy:")
	r = idemctl(t, ctx, nil, "check", "--database-url", url, "--max-expired", "10", "--json")
	var h health
	if err := json.Unmarshal([]byte(r.out), &h); err != nil || len(h.Problems) != 2 || h.DefaultRows != 3 || r.code != ExitUnhealthy {
		t.Fatalf("check --json: %+v %v %+v", h, err, r)
	}
}

// TestCheckPublicRoutines: a routine of schema idem that PUBLIC may
// execute (made by hand, or left by an old Down) makes check unhealthy.
func TestCheckPublicRoutines(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	if _, err := pool.Exec(ctx, `CREATE FUNCTION idem.by_hand() RETURNS int LANGUAGE sql AS 'SELECT 1'`); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != ExitUnhealthy {
		t.Fatalf("check: %+v", r)
	}
	oneLine(t, r.errout, "PUBLIC may execute 1 routines of schema idem (idem.by_hand())")
}

// TestCheckStuckAfterRelease: check says what its grace leaves out, where
// stats counts every lapsed lease; a stuck key released as check advises
// is no longer reported, without waiting for prune.
func TestCheckStuckAfterRelease(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	lapsed := func(key, ago string) {
		t.Helper()
		if _, err := pool.Exec(ctx, `
			INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
			VALUES ('s', $1, idem.utc_month(now()), 'processing', 1, now() - $2::interval, now() - interval '2 hours', now(), now() + interval '1 day')`, key, ago); err != nil {
			t.Fatal(err)
		}
	}
	lapsed("recent", "1 minute")
	r := idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != 0 || !strings.Contains(r.out, "0 stuck leases (ended over 10m0s ago); 1 lease ended less than 10m0s ago, stuck if no redelivery takes it by then") {
		t.Fatalf("check with a lease lapsed a minute ago: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "stats", "--database-url", url, "--json"); r.code != 0 || !strings.Contains(r.out, `"stuck_past_lease": 1`) {
		t.Fatalf("stats counts the lapsed lease: %+v", r)
	}

	lapsed("stuck", "1 hour")
	r = idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != ExitUnhealthy || !strings.Contains(r.errout, "s/stuck") || !strings.Contains(r.errout, "idemctl release --source S --key K") {
		t.Fatalf("check with a stuck key: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "release", "--database-url", url, "--source", "s", "--key", "stuck"); r.code != 0 {
		t.Fatalf("release: %+v", r)
	}
	r = idemctl(t, ctx, nil, "check", "--database-url", url)
	if r.code != 0 || !strings.Contains(r.out, "0 stuck leases") {
		t.Fatalf("check after the advised release: %+v", r)
	}
}
