package idem_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testdb"
)

// TestClaimSeesStateChanges checks idem.claim's short path (migration 27),
// which reads a source's policy, lookback and whether it has holds or an
// adoption in progress from one row of idem.claim_settings instead of the
// tables: every change of that state, committed on one connection, is
// seen by the very next claim on another, while other claims of the same
// sources keep the short path busy.
func TestClaimSeesStateChanges(t *testing.T) { testClaimSeesStateChanges(t, false) }

// TestClaimBatchSeesStateChanges checks idem.claim_batch's short path
// (migration 29) the same way: every claim, of the load and of each step,
// is a batch (the step's key first, then a new key, so the batch takes its
// locks at once and inserts its new keys in one statement when its source
// allows it), and every change is seen by the very next batch on another
// connection.
func TestClaimBatchSeesStateChanges(t *testing.T) { testClaimSeesStateChanges(t, true) }

func testClaimSeesStateChanges(t *testing.T, batch bool) {
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 16)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	type answer struct {
		outcome             string
		token               int64
		firstSeen, expireAt time.Time
	}
	claimOn := func(q interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	}, source, key string, more string) answer {
		t.Helper()
		var a answer
		var tok *int64
		var first, exp *time.Time
		sql, args := `SELECT outcome, token, first_seen, expires_at FROM idem.claim($1, $2`+more+`)`, []any{source, key}
		if batch {
			sql = `SELECT outcome, token, first_seen, expires_at FROM idem.claim_batch($1, ARRAY[$2, $3]` + more + `) WHERE ord = 1`
			args = append(args, fmt.Sprintf("%s-with-%d", key, time.Now().UnixNano()))
		}
		if err := q.QueryRow(ctx, sql, args...).Scan(&a.outcome, &tok, &first, &exp); err != nil {
			t.Fatalf("claim %s/%s: %v", source, key, err)
		}
		if tok != nil {
			a.token = *tok
		}
		if first != nil && exp != nil {
			a.firstSeen, a.expireAt = *first, *exp
		}
		return a
	}
	claim := func(source, key string) answer { t.Helper(); return claimOn(pool, source, key, "") }

	// The load: claims of new keys and duplicates of every source the
	// subtests change, from 6 connections, until the test ends.
	sources := []string{"pol", "held", "adopt", "look", "star"}
	loadCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	var claims atomic.Int64
	var loadErr atomic.Value
	for w := 0; w < 6; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := 0; loadCtx.Err() == nil; i++ {
				src := sources[i%len(sources)]
				key := fmt.Sprintf("load-%d-%d", w, i%50) // duplicates after the first 50
				sql, args := `SELECT idem.claim($1, $2)`, []any{src, key}
				if batch { // the key, a new one, and the key again
					sql, args = `SELECT count(*) FROM idem.claim_batch($1, ARRAY[$2, $3, $2])`, append(args, fmt.Sprintf("load-%d-new-%d", w, i))
				}
				if _, err := pool.Exec(loadCtx, sql, args...); err != nil && loadCtx.Err() == nil {
					loadErr.Store(err)
					return
				}
				claims.Add(1)
			}
		}(w)
	}
	t.Cleanup(func() {
		stop()
		wg.Wait()
		if err, _ := loadErr.Load().(error); err != nil {
			t.Errorf("a claim of the load failed: %v", err)
		}
		t.Logf("%d claims of the load ran meanwhile", claims.Load())
	})
	for claims.Load() < 200 {
		time.Sleep(10 * time.Millisecond)
	}

	t.Run("a policy changes", func(t *testing.T) {
		if a := claim("pol", "p0"); a.expireAt.Sub(a.firstSeen) != 30*24*time.Hour {
			t.Fatalf("before any policy of its own: ttl %v, want the default's 30 days", a.expireAt.Sub(a.firstSeen))
		}
		steps := []struct {
			sql  string
			want time.Duration
		}{
			{`INSERT INTO idem.policies (source, ttl, lease) VALUES ('pol', '3 days', '1 minute')`, 3 * 24 * time.Hour},
			{`UPDATE idem.policies SET ttl = '5 days' WHERE source = 'pol'`, 5 * 24 * time.Hour},
			{`UPDATE idem.policies SET ttl = '20 days' WHERE source = '*'`, 5 * 24 * time.Hour},
			{`DELETE FROM idem.policies WHERE source = 'pol'`, 20 * 24 * time.Hour},
			{`UPDATE idem.policies SET ttl = '30 days' WHERE source = '*'`, 30 * 24 * time.Hour},
		}
		for i, s := range steps {
			exec(s.sql)
			a := claim("pol", fmt.Sprintf("p%d", i+1))
			if a.outcome != "acquired" || a.expireAt.Sub(a.firstSeen) != s.want {
				t.Errorf("after %s: %s with ttl %v, want acquired with %v", s.sql, a.outcome, a.expireAt.Sub(a.firstSeen), s.want)
			}
		}
	})

	t.Run("a hold appears", func(t *testing.T) {
		// The key's row expires (30 days) in this month; a claim in the
		// month after next finds no live row, and its insert would go into
		// another month: only the hold keeps the key its job's.
		later := testdb.MonthStart(time.Now(), 2).Add(24 * time.Hour)
		lp := testdb.PoolAt(t, url, 2, later)
		exec(`SELECT idem.create_partition($1)`, testdb.MonthStart(time.Now(), 2))
		a := claim("held", "h1")
		if a.outcome != "acquired" {
			t.Fatalf("first claim: %s", a.outcome)
		}
		if got := claimOn(lp, "held", "h0", ""); got.outcome != "acquired" {
			t.Fatalf("a key of the source without a hold, later: %s", got.outcome)
		}
		exec(`SELECT idem.queue_hold('held', 'h1', $1, 1)`, a.token)
		if got := claimOn(lp, "held", "h1", ""); got.outcome != "in_progress" {
			t.Errorf("the very next claim of a held key whose row expired: %s, want in_progress", got.outcome)
		}
	})

	// The negative control: without the trigger that marks a source's
	// first hold, the same steps on a fresh source run the held key's work
	// a second time; the subtest above proves something only while this
	// one sees it.
	t.Run("negative control: no holds trigger", func(t *testing.T) {
		later := testdb.MonthStart(time.Now(), 2).Add(24 * time.Hour)
		lp := testdb.PoolAt(t, url, 2, later)
		exec(`ALTER TABLE idem.holds DISABLE TRIGGER claim_settings_holds`)
		defer exec(`ALTER TABLE idem.holds ENABLE TRIGGER claim_settings_holds`)
		a := claim("held-nc", "h1")
		if a.outcome != "acquired" {
			t.Fatalf("first claim: %s", a.outcome)
		}
		exec(`SELECT idem.queue_hold('held-nc', 'h1', $1, 2)`, a.token)
		if got := claimOn(lp, "held-nc", "h1", ""); got.outcome != "acquired" {
			t.Fatalf("without the trigger the held key answered %s: the hold subtest cannot tell a missing trigger", got.outcome)
		}
	})

	t.Run("an adoption starts", func(t *testing.T) {
		if a := claim("adopt", "native"); a.outcome != "acquired" {
			t.Fatalf("first claim: %s", a.outcome)
		}
		exec(`CREATE TABLE public.legacy_adopt (k text PRIMARY KEY, at timestamptz NOT NULL);
			INSERT INTO public.legacy_adopt VALUES ('leg', now() - interval '1 hour')`)
		exec(`SELECT idem.adopt_start('adopt', 'public.legacy_adopt', 'k', 'at')`)
		if a := claim("adopt", "leg"); a.outcome != "completed" {
			t.Errorf("the very next claim of a key processed in the legacy table: %s, want completed", a.outcome)
		}
		if a := claim("adopt", "notleg"); a.outcome != "acquired" {
			t.Errorf("a key the legacy table does not have: %s, want acquired", a.outcome)
		}
	})

	t.Run("the lookback is raised", func(t *testing.T) {
		// A claim 200 days ago with a 400-day ttl (another connection,
		// another month), completed, raises the source's lookback; the next claim of
		// the key, today, must look back that far.
		past := time.Now().AddDate(0, 0, -200)
		exec(`SELECT idem.create_partition($1)`, testdb.MonthStart(past, 0))
		pp := testdb.PoolAt(t, url, 2, past)
		if a := claim("look", "l0"); a.outcome != "acquired" {
			t.Fatalf("first claim: %s", a.outcome)
		}
		a := claimOn(pp, "look", "old", ", ttl => '400 days'")
		if a.outcome != "acquired" {
			t.Fatalf("claim 200 days ago: %s", a.outcome)
		}
		if _, err := pp.Exec(ctx, `SELECT idem.complete('look', 'old', $1, '{"paid": true}')`, a.token); err != nil {
			t.Fatal(err)
		}
		if a := claim("look", "old"); a.outcome != "completed" {
			t.Errorf("the very next claim of a key completed 200 days ago with a 400-day ttl: %s, want completed", a.outcome)
		}
	})

	t.Run("a waiter waits", func(t *testing.T) {
		a := claim("star", "w1")
		if a.outcome != "acquired" {
			t.Fatalf("first claim: %s", a.outcome)
		}
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Release()
		if _, err := conn.Exec(ctx, `LISTEN idem_done`); err != nil {
			t.Fatal(err)
		}
		var id int64
		if err := conn.QueryRow(ctx, `SELECT idem.wait_begin('star', 'w1', interval '30 seconds')`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		exec(`SELECT idem.complete('star', 'w1', $1, '{"ok": true}')`, a.token)
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if _, err := conn.Conn().WaitForNotification(wctx); err != nil {
			t.Errorf("the waiter was not notified of the completion: %v", err)
		}
		if _, err := conn.Exec(ctx, `SELECT idem.wait_end($1)`, id); err != nil {
			t.Fatal(err)
		}
	})
}

// TestClaimSettingsFollowTheTables checks that idem.claim_settings is, after
// any sequence of changes, what idem.claim_settings_refresh computes from
// the tables it is derived from (the triggers miss nothing).
func TestClaimSettingsFollowTheTables(t *testing.T) {
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	for _, sql := range []string{
		`INSERT INTO idem.policies (source, ttl, lease) VALUES ('a', '3 days', '1 minute'), ('b', '400 days', '1 hour')`,
		`SELECT idem.claim('c', 'k')`,
		`SELECT idem.claim('a', 'k', ttl => '90 days')`,
		`UPDATE idem.policies SET source = 'b2' WHERE source = 'b'`,
		`UPDATE idem.policies SET max_attempts = 3, duplicate_sampling = 2 WHERE source = '*'`,
		`SELECT idem.claim('d', 'k', ttl => '2 years')`,
		`DELETE FROM idem.policies WHERE source = 'a'`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		if diff := settingsDiff(ctx, t, pool); diff != "" {
			t.Fatalf("after %s: idem.claim_settings differs from the tables: %s", sql, diff)
		}
	}
}

func settingsDiff(ctx context.Context, t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var before string
	if err := tx.QueryRow(ctx, `SELECT coalesce(string_agg(c::text, ' ' ORDER BY c.source), '') FROM idem.claim_settings c`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT idem.claim_settings_refresh(NULL)`); err != nil {
		t.Fatal(err)
	}
	var after string
	if err := tx.QueryRow(ctx, `SELECT coalesce(string_agg(c::text, ' ' ORDER BY c.source), '') FROM idem.claim_settings c`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if before != after {
		return fmt.Sprintf("kept %s, computed %s", before, after)
	}
	if before == "" {
		return "empty"
	}
	return ""
}

// TestClaimBatchAdoptionBetweenItsReads: a batch on the short path reads
// its source's settings twice, before its locks and under them. An
// adoption the first read did not see and the second does (here: the
// source has no settings row of its own, so the first read takes the
// default's, with no adoption, and the batch's own write of the source's
// row finds the adoption in progress) makes the batch insert nothing at
// once: every key is answered as under an adoption (the legacy table's
// keys completed, repeated ones too, the others acquired).
func TestClaimBatchAdoptionBetweenItsReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 4)
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`CREATE TABLE public.legacy_between (k text PRIMARY KEY, at timestamptz NOT NULL);
		INSERT INTO public.legacy_between VALUES ('leg', now() - interval '1 hour')`)
	exec(`SELECT idem.adopt_start('between', 'public.legacy_between', 'k', 'at')`)
	exec(`DELETE FROM idem.claim_settings WHERE source = 'between'`)
	rows, err := pool.Query(ctx, `SELECT outcome FROM idem.claim_batch('between', ARRAY['new1', 'leg', 'new2', 'leg']) ORDER BY ord`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"acquired", "completed", "acquired", "completed"}; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("the batch answered %v, want %v", got, want)
	}
	var adopting bool
	if err := pool.QueryRow(ctx, `SELECT adopting FROM idem.claim_settings WHERE source = 'between'`).Scan(&adopting); err != nil || !adopting {
		t.Errorf("the batch's write of the source's settings: adopting %v (%v), want true", adopting, err)
	}
}
