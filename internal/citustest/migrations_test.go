package citustest_test

// A test per migration since 13 on Citus (docs/citus.md, "Migrations on
// Citus"): what each one changed, run on the loopback cluster.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// codeOf is err's SQLSTATE, "" for none.
func codeOf(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// completeKey claims key and completes it with result, each call delegated
// (the key a parameter, as the Go API sends it).
func completeKey(t *testing.T, pool *pgxpool.Pool, source, key, result string) {
	t.Helper()
	ctx := context.Background()
	var token int64
	if err := pool.QueryRow(ctx, `SELECT token FROM idem.claim($1, $2)`, source, key).Scan(&token); err != nil {
		t.Fatalf("claim %s: %v", key, err)
	}
	var out string
	if err := pool.QueryRow(ctx, `SELECT idem.complete($1, $2, $3, $4::jsonb)`, source, key, token, result).Scan(&out); err != nil || out != "completed" {
		t.Fatalf("complete %s: %q %v", key, out, err)
	}
}

// loginRole creates (again) a login role on the coordinator (Citus
// creates it on the workers) and returns a pool that logs in as it.
func loginRole(t *testing.T, admin *pgxpool.Pool, role, grant string) *pgxpool.Pool {
	t.Helper()
	ctx := context.Background()
	// (role is one of the tests' constant names)
	if _, err := admin.Exec(ctx, `DO $$ BEGIN
		IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '`+role+`') THEN CREATE ROLE `+role+` LOGIN; END IF; END $$`); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, `SELECT idem.`+grant+`($1)`, role); err != nil {
		t.Fatalf("idem.%s(%s): %v", grant, role, err)
	}
	u, err := url.Parse(admin.Config().ConnString())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestCitusLeastPrivilege (migrations 12, 14, 28): the application's role
// (idem.grant_app) claims and completes through Do, delegated to the
// workers, claims a batch, and may not prune; the maintainer's role (idem.grant_maintainer)
// prunes (the deletes run on the workers as that role) and rotates, its
// maintenance lease the row in idem.maintenance_locks; no role holds both.
func TestCitusLeastPrivilege(t *testing.T) {
	admin := setup(t)
	ctx := context.Background()
	app := loginRole(t, admin, "idem_citus_app", "grant_app")
	maint := loginRole(t, admin, "idem_citus_maint", "grant_maintainer")

	c, err := idem.New(app, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 40 {
		key := fmt.Sprintf("lp%d", i)
		r, err := c.Do(ctx, "c", key, func(context.Context) (any, error) { return key, nil })
		if err != nil || r.Replayed {
			t.Fatalf("Do %s as the application's role: %+v %v", key, r, err)
		}
		if r, err := c.Do(ctx, "c", key, func(context.Context) (any, error) { return nil, errors.New("ran twice") }); err != nil || !r.Replayed {
			t.Fatalf("the duplicate of %s: %+v %v", key, r, err)
		}
	}
	// A batch as the application's role (migration 28's functions are the
	// application's: idem.rights).
	batch := make([]idem.BatchItem, 10)
	for i := range batch {
		batch[i] = idem.BatchItem{Key: fmt.Sprintf("lp-batch%d", i)}
	}
	if cls, err := c.ClaimBatch(ctx, "c", batch); err != nil || cls[0].Outcome != idem.Acquired {
		t.Fatalf("ClaimBatch as the application's role: %v %v", cls, err)
	}
	if _, err := prune.Run(ctx, app, prune.Config{}); codeOf(err) != "42501" {
		t.Fatalf("prune as the application's role: %v, want SQLSTATE 42501", err)
	}
	// Expired rows on every shard, deleted by the maintainer's prune.
	if _, err := admin.Exec(ctx, `INSERT INTO idem.processed_events
		(source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at, completed_at)
		SELECT 'c', 'lp-old' || g, idem.utc_month(now()), 'completed', 1, g, now() - interval '2 days', now() - interval '2 days',
		       now() - interval '1 day', now() - interval '2 days' FROM generate_series(1, 200) g`); err != nil {
		t.Fatal(err)
	}
	res, err := prune.Run(ctx, maint, prune.Config{})
	if err != nil || res.Deleted != 200 {
		t.Fatalf("prune as the maintainer's role: %+v %v, want 200 rows deleted", res, err)
	}
	premake := 4
	if _, err := partition.Rotate(ctx, maint, partition.Config{Premake: &premake}); err != nil {
		t.Fatalf("rotation as the maintainer's role: %v", err)
	}
	var conflicts int
	if err := admin.QueryRow(ctx, `SELECT count(*) FROM idem.role_conflicts()`).Scan(&conflicts); err != nil || conflicts != 0 {
		t.Fatalf("idem.role_conflicts(): %d rows, %v", conflicts, err)
	}
	if _, err := admin.Exec(ctx, `SELECT idem.grant_maintainer('idem_citus_app')`); codeOf(err) != sqlstate.RoleConflict {
		t.Fatalf("the maintainer's rights for the application's role: %v, want %s", err, sqlstate.RoleConflict)
	}
}

// TestCitusHostileInput (migration 15): keys a client may send (quotes,
// backslashes, control characters, percent signs, Unicode, 512 bytes) are
// each routed to the node of their shard, claimed once and answered as
// duplicates there; a source with a control character, and a key over 512
// bytes, are refused by the worker's checks with the single node's
// SQLSTATEs, writing nothing.
func TestCitusHostileInput(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	hostile := []string{
		`'; DROP SCHEMA idem CASCADE; --`, `back\slash`, "tab\tand\nnewline", `100%_like`, "ключ-キー-🔑",
		strings.Repeat("x", 512), " leading and trailing ", `"quoted"`, "$$dollar$$", "nul-free\x7f",
	}
	for _, key := range hostile {
		r, err := c.Do(ctx, "c", key, func(context.Context) (any, error) { return key, nil })
		if err != nil || r.Replayed {
			t.Fatalf("Do %q: %+v %v", key, r, err)
		}
		var outcome string
		if err := pool.QueryRow(ctx, `SELECT outcome FROM idem.claim('c', $1)`, key).Scan(&outcome); err != nil || outcome != "completed" {
			t.Fatalf("the duplicate of %q: %q %v", key, outcome, err)
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key = ANY($1) AND status = 'completed'`, hostile).Scan(&rows); err != nil || rows != len(hostile) {
		t.Fatalf("%d completed rows for %d keys, %v", rows, len(hostile), err)
	}
	for _, tc := range []struct{ source, key, code string }{
		{"bad\x1fsource", "k", sqlstate.InvalidParameterValue},
		{"c", strings.Repeat("y", 513), sqlstate.StringDataRightTrunc},
		{"c", "   ", sqlstate.InvalidParameterValue},
	} {
		_, err := pool.Exec(ctx, `SELECT outcome FROM idem.claim($1, $2)`, tc.source, tc.key)
		if codeOf(err) != tc.code {
			t.Errorf("claim(%q, %.20q...): %v, want SQLSTATE %s", tc.source, tc.key, err, tc.code)
		}
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events`).Scan(&rows); err != nil || rows != len(hostile) {
		t.Fatalf("%d rows after the refused claims, want %d (%v)", rows, len(hostile), err)
	}
}

// TestCitusReadOnlyDuplicates (migrations 16, 24): a duplicate of a
// completed key is answered in a read-only transaction (as on a hot
// standby), delegated to its worker, with counting on (sampling 1) and a
// ttl above the source's lookback: nothing is written, no error; a new
// key there fails with 25006, as on a single node.
func TestCitusReadOnlyDuplicates(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	for i := range 20 {
		completeKey(t, pool, "c", fmt.Sprintf("ro%d", i), `"done"`)
	}
	for i := range 20 {
		key := fmt.Sprintf("ro%d", i)
		err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
			var outcome, result string
			if err := tx.QueryRow(ctx, `SELECT outcome, result::text FROM idem.claim('c', $1, ttl => interval '5 years')`, key).Scan(&outcome, &result); err != nil {
				return err
			}
			if outcome != "completed" || result != `"done"` {
				return fmt.Errorf("%s answered %s %s", key, outcome, result)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("a duplicate in a read-only transaction: %v", err)
		}
	}
	err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `SELECT outcome FROM idem.claim('c', 'ro-new')`)
		return err
	})
	if codeOf(err) != "25006" {
		t.Fatalf("a new key in a read-only transaction: %v, want SQLSTATE 25006", err)
	}
}

// TestCitusMomentaryRelease (migration 20): a momentary failure
// (idem.Momentary, idem.fail with retryable NULL), delegated to the key's
// worker, releases the key and takes its attempt back: with max_attempts 2,
// three momentary failures in a row still leave the key to run, once.
func TestCitusMomentaryRelease(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `UPDATE idem.policies SET max_attempts = 2 WHERE source = 'c'`); err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range keys("mr", 10) {
		for range 3 {
			if _, err := c.Do(ctx, "c", key, func(context.Context) (any, error) {
				return nil, idem.Momentary(errors.New("429 Too Many Requests"))
			}); err == nil {
				t.Fatal("a momentary failure returned no error")
			}
		}
		var attempts int
		if err := pool.QueryRow(ctx, `SELECT attempts FROM idem.processed_events WHERE source = 'c' AND key = $1`, key).Scan(&attempts); err != nil || attempts != 0 {
			t.Fatalf("%s after 3 momentary failures: %d attempts (%v), want 0", key, attempts, err)
		}
		r, err := c.Do(ctx, "c", key, func(context.Context) (any, error) { return "ran", nil })
		if err != nil || r.Replayed || r.Claim == nil || r.Claim.Attempt != 1 {
			t.Fatalf("%s once the limit lifts: %+v %v", key, r, err)
		}
	}
}

// TestCitusSerializable (migration 21): a claim in a SERIALIZABLE
// transaction on Citus. Migration 21's placeholder inserts into the other
// months are off there (idem.citus): a delegated claim runs on the worker
// in the transaction Citus opens there, so this checks what that gives:
// claims of new keys and duplicates answer in SERIALIZABLE, and racing
// SERIALIZABLE and READ COMMITTED clients still run each key once. A
// serialization failure Citus meets committing a worker's part comes back
// as XX000 ("could not commit transaction for shard"), not 40001: the
// clients retry it too (docs/citus.md, Limits).
func TestCitusSerializable(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	ser := pgx.TxOptions{IsoLevel: pgx.Serializable}
	var outcome string
	for i, want := range []string{"acquired", "in_progress"} {
		err := pgx.BeginTxFunc(ctx, pool, ser, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, `SELECT outcome FROM idem.claim('c', 'ser', lock_wait => interval '0')`).Scan(&outcome)
		})
		if err != nil || outcome != want {
			t.Fatalf("claim %d of a key in SERIALIZABLE: %q %v, want %s", i+1, outcome, err, want)
		}
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	ks := keys("s", 200)
	var mu sync.Mutex
	runs := map[string]int{}
	errs := make(chan error, 8)
	for g := range 8 {
		go func() {
			var err error
			defer func() { errs <- err }()
			for i := range ks {
				key := ks[(g*25+i)%len(ks)]
				work := func(context.Context) (any, error) { return key, nil }
				opts := pgx.TxOptions{}
				if g%2 == 0 {
					opts = ser
				}
				for {
					var r *idem.Result
					err = pgx.BeginTxFunc(ctx, pool, opts, func(tx pgx.Tx) error {
						var err error
						r, err = c.WithTx(tx).Do(ctx, "c", key, work)
						return err
					})
					// A serialization failure found when Citus commits the
					// worker's part (two-phase) comes back as XX000 "could
					// not commit transaction for shard": retried as well.
					if errors.Is(err, idem.ErrSerialization) || errors.Is(err, idem.ErrInProgress) || codeOf(err) == sqlstate.SerializationFailure ||
						codeOf(err) == "XX000" && strings.Contains(err.Error(), "could not commit transaction") {
						continue
					}
					if err != nil {
						return
					}
					if !r.Replayed {
						mu.Lock()
						runs[key]++
						mu.Unlock()
					}
					break
				}
			}
		}()
	}
	for range 8 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range ks {
		if runs[k] != 1 {
			t.Errorf("key %s ran %d times, want 1", k, runs[k])
		}
	}
}

// TestCitusSampledCounting (migrations 19, 24): above the exact-counting
// rate, a claim delegated to a worker samples its duplicates (1 in the
// policy's duplicate_sampling, weighted) with the worker's own count of
// the minute, without the secret that signs idem.sampled_minute on a
// single node; the workers' counts reach the coordinator at the next prune.
func TestCitusSampledCounting(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('loud', '1 day', '1 minute', 4)`); err != nil {
		t.Fatal(err)
	}
	var rate int
	if err := pool.QueryRow(ctx, `SELECT idem.exact_counting_rate()`).Scan(&rate); err != nil {
		t.Fatal(err)
	}
	// Twice the rate on each worker: one key per worker, its duplicates.
	hot := map[int]string{} // worker's port: its key
	for i := 0; len(hot) < 2 && i < 100; i++ {
		key := fmt.Sprintf("hot%d", i)
		var port int
		if err := pool.QueryRow(ctx, `SELECT nodeport FROM citus_shards WHERE shardid = get_shard_id_for_distribution_column('idem.processed_events', $1::text) LIMIT 1`, key).Scan(&port); err != nil {
			t.Fatal(err)
		}
		if _, ok := hot[port]; !ok {
			hot[port] = key
		}
	}
	b := &pgx.Batch{}
	for _, key := range hot {
		completeKey(t, pool, "loud", key, "1")
		for range 2 * rate {
			b.Queue(`SELECT outcome FROM idem.claim('loud', $1)`, key)
		}
	}
	if err := pool.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	// A redelivered batch above the rate samples its duplicates on the
	// workers too (the shards' copies of claim_batch run as on Citus: a
	// copy that took the single node's path failed with "relation
	// idem.sampling_key_a does not exist").
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	redelivered := []idem.BatchItem{}
	for _, key := range hot {
		redelivered = append(redelivered, idem.BatchItem{Key: key})
	}
	for range 10 {
		cls, err := c.ClaimBatch(ctx, "loud", redelivered)
		if err != nil {
			t.Fatalf("a redelivered batch above the exact-counting rate: %v", err)
		}
		for _, cl := range cls {
			if cl.Outcome != idem.Completed {
				t.Fatalf("a redelivered key: %s", cl.Outcome)
			}
		}
	}
	if _, err := prune.Run(ctx, pool, prune.Config{}); err != nil {
		t.Fatal(err)
	}
	var dups, acquired int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'loud'),
		(SELECT coalesce(sum(acquired), 0) FROM idem.activity WHERE source = 'loud')`).Scan(&dups, &acquired); err != nil {
		t.Fatal(err)
	}
	t.Logf("keys %v: %d duplicates counted (of %d), %d acquisitions", hot, dups, 4*rate, acquired)
	if acquired != 2 {
		t.Errorf("%d acquisitions counted, want 2", acquired)
	}
	// Exact below the rate on each worker (a minute's end may restart
	// it), sampled with weight 4 above it: an estimate of the 4 x rate.
	if dups < int64(rate) || dups > int64(8*rate) {
		t.Errorf("%d duplicates counted for %d", dups, 4*rate)
	}
}

// TestCitusMoveDefaultRefused (migration 25): moving the default
// partition's rows is refused on a distributed installation (ID006),
// moving nothing; rotation's --move-default says so.
func TestCitusMoveDefaultRefused(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `SELECT idem.move_default_month(date_trunc('month', now())::date, 1000)`)
	if codeOf(err) != sqlstate.Distributed {
		t.Fatalf("idem.move_default_month on Citus: %v, want SQLSTATE %s", err, sqlstate.Distributed)
	}
	// A row of a month without a partition lands in the default one (on
	// its worker); rotation asked to move it is refused the same way.
	if _, err := pool.Exec(ctx, `INSERT INTO idem.processed_events
		(source, key, first_seen_month, status, attempts, token, first_seen, updated_at, expires_at)
		VALUES ('c', 'in-default', (date_trunc('month', now()) - interval '2 years')::date, 'completed', 1, 1, now(), now(), now() + interval '1 day')`); err != nil {
		t.Fatal(err)
	}
	premake := 1
	_, err = partition.Rotate(ctx, pool, partition.Config{Premake: &premake, MoveDefault: true})
	if codeOf(err) != sqlstate.Distributed {
		t.Fatalf("rotation moving the default partition on Citus: %v, want SQLSTATE %s", err, sqlstate.Distributed)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events_default WHERE key = 'in-default'`).Scan(&left); err != nil || left != 1 {
		t.Fatalf("the default partition's row after the refused move: %d (%v), want 1", left, err)
	}
}

// TestCitusPendingDrops (migration 26): rotation retires a past month of
// the distributed table (detached, marked, dropped with its shards), and a
// month an earlier rotation detached and marked but did not drop is
// dropped by the next one, shards included.
func TestCitusPendingDrops(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	old := time.Now().UTC().AddDate(-2, 0, 0)
	older := old.AddDate(0, -1, 0)
	var oldName, olderName string
	for _, m := range []struct {
		at   time.Time
		name *string
	}{{old, &oldName}, {older, &olderName}} {
		if err := pool.QueryRow(ctx, `SELECT idem.create_partition($1::date)`, m.at.Format("2006-01-02")).Scan(m.name); err != nil {
			t.Fatalf("create the month of %s: %v", m.at.Format("2006-01"), err)
		}
		*m.name = "idem." + *m.name
	}
	// The older month as a rotation stopped between detach and drop
	// leaves it.
	for _, q := range []string{
		`ALTER TABLE idem.processed_events DETACH PARTITION ` + olderName,
		`SELECT idem.mark_for_drop('` + olderName + `'::regclass)`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var pending int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.detached_months() WHERE drop_pending`).Scan(&pending); err != nil || pending != 1 {
		t.Fatalf("detached months pending a drop: %d (%v), want 1", pending, err)
	}
	premake := 2
	res, err := partition.Rotate(ctx, pool, partition.Config{Premake: &premake})
	if err != nil {
		t.Fatalf("rotate: %+v %v", res, err)
	}
	t.Logf("rotation: %+v", res.Steps)
	for _, name := range []string{oldName, olderName} {
		var left, shards int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_class WHERE oid = to_regclass($1)`, name).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, `SELECT coalesce(sum(nullif(result, '')::int), 0) FROM run_command_on_workers(format(
			$$SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'idem' AND c.relname LIKE %L$$, $1::text || '\_%'))`,
			strings.TrimPrefix(name, "idem.")).Scan(&shards); err != nil {
			t.Fatal(err)
		}
		if left != 0 || shards != 0 {
			t.Errorf("%s after rotation: %d tables on the coordinator, %d shards on the workers; want none", name, left, shards)
		}
	}
}

// TestCitusUpgradeFrom13: an installation distributed at migration 13,
// holding keys, migrated to the latest version (migrate.Up, which runs
// migrate.Citus at the end): every migration since applies to the
// distributed tables (migration 17's column of idem.holds and 19's index
// reach every shard), the keys claimed before are answered as duplicates,
// new keys are claimed on the workers, and an undelegated claim is still
// refused (ID005).
func TestCitusUpgradeFrom13(t *testing.T) {
	url := testdb.Citus(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	if _, err := pool.Exec(ctx, `DROP SCHEMA idem CASCADE`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT run_command_on_workers('DROP SCHEMA IF EXISTS idem CASCADE')`); err != nil {
		t.Fatal(err)
	}
	p, err := migrate.NewProvider(db)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := p.UpTo(ctx, 13); err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Citus(ctx, db); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('c', '1 day', '1 minute', 1)`); err != nil {
		t.Fatal(err)
	}
	before := keys("u13-", 50)
	for _, k := range before {
		completeKey(t, pool, "c", k, `"at 13"`)
	}
	if _, err := migrate.Up(ctx, db); err != nil {
		t.Fatalf("migrate.Up from 13 on Citus: %v", err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range before {
		r, err := c.Do(ctx, "c", k, func(context.Context) (any, error) { return nil, errors.New("ran again") })
		if err != nil || !r.Replayed || string(r.Result) != `"at 13"` {
			t.Fatalf("%s claimed at 13, after the upgrade: %+v %v", k, r, err)
		}
	}
	for _, k := range keys("u-new-", 50) {
		if r, err := c.Do(ctx, "c", k, func(context.Context) (any, error) { return "new", nil }); err != nil || r.Replayed {
			t.Fatalf("%s after the upgrade: %+v %v", k, r, err)
		}
	}
	_, err = pool.Exec(ctx, `SELECT (idem.claim('c', v.k)).outcome FROM (VALUES ('undelegated-up')) v(k)`)
	if codeOf(err) != sqlstate.NotDelegated {
		t.Fatalf("an undelegated claim after the upgrade: %v, want %s", err, sqlstate.NotDelegated)
	}
	var missing int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM run_command_on_workers($$
		SELECT (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		         WHERE n.nspname = 'idem' AND c.relname ~ '^holds_[0-9]+$'
		           AND NOT EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attname = 'payload'))
		     + (SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		         WHERE n.nspname = 'idem' AND c.relname ~ '^processed_events_[0-9]+$'
		           AND NOT EXISTS (SELECT 1 FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
		                            WHERE i.indrelid = c.oid AND ic.relname LIKE 'processed_events_expires_order_idx%'))$$) r
		WHERE NOT r.success OR r.result <> '0'`).Scan(&missing); err != nil || missing != 0 {
		t.Fatalf("workers whose shards lack holds.payload or the expires order index: %d (%v)", missing, err)
	}
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_dist_object o WHERE o.classid = 'pg_proc'::regclass
		AND o.objid = 'idem.claim(text, text, text, interval, interval, text, interval)'::regprocedure AND o.force_delegation`).Scan(&missing); err != nil || missing != 1 {
		t.Fatalf("claim delegated after the upgrade: %d (%v)", missing, err)
	}
}

// TestCitusShardClaims (migrations 28 and 34): a delegated claim is answered
// by the claim's copy on its key's shard (idem_shard_<shard>.claim, the
// short path, since migration 34; idem_shard_<shard>.claim_general before;
// PostgreSQL's own cached plans): every claim of 200 keys through Do ran in
// a copy on a worker; the application's role cannot call a copy; a shard whose copy
// is gone is claimed as before, through Citus, and migrate.Citus makes the
// copy again; a copy follows a claim that changed (its md5).
func TestCitusShardClaims(t *testing.T) {
	pool := setup(t)
	trackFunctions(t, pool)
	ctx := context.Background()
	var copies int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_namespace WHERE nspname ~ '^idem_shard_[0-9]+$'`).Scan(&copies); err != nil {
		t.Fatal(err)
	}
	var shards int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_dist_shard WHERE logicalrelid = 'idem.processed_events'::regclass`).Scan(&shards); err != nil || copies != shards {
		t.Fatalf("%d copies for %d shards (%v)", copies, shards, err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	const n = 200
	for _, k := range keys("sc", n) {
		if r, err := c.Do(ctx, "c", k, func(context.Context) (any, error) { return k, nil }); err != nil || r.Replayed {
			t.Fatalf("Do %s: %+v %v", k, r, err)
		}
	}
	inCopies := func(want int64) int64 {
		t.Helper()
		var got int64
		for deadline := time.Now().Add(40 * time.Second); ; time.Sleep(time.Second) {
			if err := pool.QueryRow(ctx, `SELECT coalesce(sum(nullif(result, '')::bigint), 0) FROM run_command_on_workers(
				$$SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE schemaname ~ '^idem_shard_' AND funcname = 'claim'$$)`).Scan(&got); err != nil {
				t.Fatal(err)
			}
			if got >= want || time.Now().After(deadline) {
				return got
			}
		}
	}
	if got := inCopies(n); got != n {
		t.Fatalf("%d of %d claims answered by the shards' copies", got, n)
	}

	app := loginRole(t, pool, "idem_citus_app", "grant_app")
	var copy string
	if err := pool.QueryRow(ctx, `SELECT 'idem_shard_' || get_shard_id_for_distribution_column('idem.processed_events', 'moved'::text)`).Scan(&copy); err != nil {
		t.Fatal(err)
	}
	for _, fn := range []string{"claim_general", "claim"} {
		if _, err := app.Exec(ctx, `SELECT * FROM `+copy+`.`+fn+`('c', 'moved')`); codeOf(err) != "42501" {
			t.Fatalf("the application's role calling a copy of %s: %v, want SQLSTATE 42501", fn, err)
		}
	}

	// Without its copy, the shard's keys are claimed through Citus.
	if _, err := pool.Exec(ctx, `DROP SCHEMA `+copy+` CASCADE`); err != nil {
		t.Fatal(err)
	}
	if r, err := c.Do(ctx, "c", "moved", func(context.Context) (any, error) { return "ok", nil }); err != nil || r.Replayed {
		t.Fatalf("Do without the shard's copy: %+v %v", r, err)
	}
	if r, err := c.Do(ctx, "c", "moved", func(context.Context) (any, error) { return nil, errors.New("ran twice") }); err != nil || !r.Replayed {
		t.Fatalf("its duplicate: %+v %v", r, err)
	}
	_, err = pool.Exec(ctx, `SELECT (idem.claim('c', v.k)).outcome FROM (VALUES ('moved')) v(k)`)
	if codeOf(err) != sqlstate.NotDelegated {
		t.Fatalf("an undelegated claim: %v, want %s", err, sqlstate.NotDelegated)
	}
	done, err := migrate.Citus(ctx, stdlib.OpenDBFromPool(pool))
	if err != nil || len(done) != 1 || !strings.Contains(done[0], "made 4 copies") { // claim_general's, claim_batch's, (migration 30) claim_locked, (34) claim's
		t.Fatalf("migrate.Citus after a copy was dropped: %q %v", done, err)
	}

	// A claim that changed (here: a comment in its body) gets new copies.
	if _, err := pool.Exec(ctx, `DO $$ DECLARE d text := pg_get_functiondef('idem.claim_general(text, text, text, interval, interval, text, interval)'::regprocedure);
		BEGIN EXECUTE replace(d, '#variable_conflict use_column', '#variable_conflict use_column
-- changed'); END $$`); err != nil {
		t.Fatal(err)
	}
	done, err = migrate.Citus(ctx, stdlib.OpenDBFromPool(pool))
	if err != nil || !slices.ContainsFunc(done, func(s string) bool { return strings.Contains(s, fmt.Sprintf("made %d copies", shards)) }) {
		t.Fatalf("migrate.Citus after the claim changed: %q %v", done, err)
	}
	var stale int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
		WHERE n.nspname ~ '^idem_shard_' AND p.proname = 'claim_general' AND p.prosrc NOT LIKE '%-- changed%'`).Scan(&stale); err != nil || stale != 0 {
		t.Fatalf("%d copies of the old claim left (%v)", stale, err)
	}
}

// TestCitusBatch (migrations 18, 22, 23, 28): ClaimBatch on Citus, refused
// there before (ID006): the keys are grouped by node (idem.citus_batch_routes)
// and each group claimed on its node in one delegated call
// (idem.citus_claim_batch; on the node, each shard's keys by the shard's
// copy of idem.claim_batch). A batch of 100 new keys: each acquired once,
// on both workers; the same batch again: every key in progress; completed
// one by one, then replayed by a batch; a key twice in a batch: the second
// in progress; in the caller's transaction, rolled back: nothing written;
// 6 clients with overlapping batches over 300 keys in different orders:
// each key acquired once, no deadlock.
func TestCitusBatch(t *testing.T) {
	pool := setup(t)
	ctx := context.Background()
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	items := func(ks []string) []idem.BatchItem {
		out := make([]idem.BatchItem, len(ks))
		for i, k := range ks {
			out[i] = idem.BatchItem{Key: k}
		}
		return out
	}
	ks := keys("b", 100)
	cls, err := c.ClaimBatch(ctx, "c", items(ks))
	if err != nil {
		t.Fatalf("ClaimBatch of 100 new keys on Citus: %v", err)
	}
	for i, cl := range cls {
		if cl.Key != ks[i] || cl.Outcome != idem.Acquired || cl.Token == 0 {
			t.Fatalf("item %d: %+v", i, cl)
		}
	}
	var rowsN, nodes int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM idem.processed_events WHERE source = 'c' AND key = ANY($1)),
		(SELECT count(DISTINCT s.nodeport) FROM unnest($1::text[]) k
		   JOIN citus_shards s ON s.table_name = 'idem.processed_events'::regclass
		    AND s.shardid = get_shard_id_for_distribution_column('idem.processed_events', k))`, ks).Scan(&rowsN, &nodes); err != nil || rowsN != 100 || nodes != 2 {
		t.Fatalf("%d rows of the 100 keys, on %d nodes (%v); want 100 on 2", rowsN, nodes, err)
	}
	again, err := c.ClaimBatch(ctx, "c", items(ks), idem.WithLockWait(0))
	if err != nil {
		t.Fatal(err)
	}
	for i, cl := range again {
		if cl.Outcome != idem.InProgress {
			t.Fatalf("item %d claimed again: %s", i, cl.Outcome)
		}
	}
	for _, cl := range cls {
		if err := c.Complete(ctx, "c", cl.Key, cl.Token, json.RawMessage(`"`+cl.Key+`"`)); err != nil {
			t.Fatal(err)
		}
	}
	replay, err := c.ClaimBatch(ctx, "c", items(ks))
	if err != nil {
		t.Fatal(err)
	}
	for i, cl := range replay {
		if cl.Outcome != idem.Completed || string(cl.Result) != `"`+ks[i]+`"` {
			t.Fatalf("item %d replayed: %s %s", i, cl.Outcome, cl.Result)
		}
	}

	// DoBatch: the work runs once for each key; its results recorded.
	dks := keys("db", 30)
	runs := 0
	work := func(_ context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
		out := make([]idem.WorkResult, len(acquired))
		for i, cl := range acquired {
			runs++
			out[i] = idem.WorkResult{Value: cl.Key}
			if cl.Key == dks[0] && runs == 1 {
				out[i] = idem.WorkResult{Err: errors.New("transient")} // released for a retry
			}
		}
		return out, nil
	}
	for round := range 2 {
		res, err := c.DoBatch(ctx, "c", items(dks), work)
		if err != nil {
			t.Fatalf("DoBatch round %d on Citus: %v", round, err)
		}
		for i, r := range res {
			if r.Err != nil && (round == 1 || i > 0) && !errors.Is(r.Err, idem.ErrInProgress) {
				t.Fatalf("DoBatch round %d item %d: %v", round, i, r.Err)
			}
		}
	}
	if runs != 31 { // 30 keys, and the released one again
		t.Fatalf("DoBatch ran the work %d times, want 31", runs)
	}

	twice, err := c.ClaimBatch(ctx, "c", items([]string{"dup", "other", "dup"}), idem.WithLockWait(0))
	if err != nil || twice[0].Outcome != idem.Acquired || twice[1].Outcome != idem.Acquired || twice[2].Outcome != idem.InProgress {
		t.Fatalf("a key twice in a batch: %v %v", twice, err)
	}

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rolled := keys("rb", 20)
	if cls, err := c.WithTx(tx).ClaimBatch(ctx, "c", items(rolled)); err != nil || len(cls) != 20 || cls[0].Outcome != idem.Acquired {
		t.Fatalf("ClaimBatch in a transaction: %v %v", cls, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events WHERE key = ANY($1)`, rolled).Scan(&n); err != nil || n != 0 {
		t.Fatalf("after the rollback: %d rows (%v)", n, err)
	}

	// Overlapping batches, each client's keys in another order.
	all := keys("ob", 300)
	var mu sync.Mutex
	acquired := map[string]int{}
	var wg sync.WaitGroup
	errs := make(chan error, 6)
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := range 6 {
				batch := make([]string, 0, 100)
				for i := range 100 {
					batch = append(batch, all[(g*37+round*50+i*(g+1))%len(all)])
				}
				cls, err := c.ClaimBatch(ctx, "c", items(batch))
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				for _, cl := range cls {
					if cl.Outcome == idem.Acquired {
						acquired[cl.Key]++
					}
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatalf("an overlapping batch: %v", err)
	}
	for k, n := range acquired {
		if n != 1 {
			t.Errorf("key %s acquired %d times", k, n)
		}
	}
	t.Logf("%d of the 300 keys acquired by the overlapping batches", len(acquired))
}
