package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
)

// The batch section: a queue consumer's batch (1, 10, 100 and 1000 keys of
// one source) claimed in one call, on a durable server and with fsync off,
// 8 and 32 clients, new keys and duplicates (keys completed before the
// run), in keys per second, each a median ratio of interleaved rounds:
//
//   - SQL level: idem.claim_batch against (a) the raw multi-row INSERT ..
//     ON CONFLICT DO NOTHING RETURNING of the same batch into a plain table
//     of processed_events' columns and indexes, and against idem.claim per
//     key (batch of 100);
//   - end to end, through the Go API: DoBatch (claim, no-op work, complete:
//     2 round trips, 4 in the caller's transaction) against (b) the
//     hand-written batch pattern (a multi-row insert-first, a SELECT of the
//     stored results of the conflicts, one UPDATE .. FROM unnest
//     completion), (c) the hand-written per-message pattern, message after
//     message, and (d) idem's Do per key; autocommit and inside the
//     caller's transaction.

const batchDupKeys = 20000

// batchSeed (a format of batchDupKeys) makes the hand-written batch
// pattern's table and the duplicates: batchDupKeys keys completed before
// the run, in it and in idem.processed_events (source "batch").
const batchSeed = `
		CREATE TABLE hw_batch (key text PRIMARY KEY, status text NOT NULL, result jsonb, at timestamptz NOT NULL DEFAULT now());
		INSERT INTO hw_batch (key, status, result) SELECT 'dup-' || g, 'completed', '{"ok": true}' FROM generate_series(1, %[1]d) g;
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, completed_at, expires_at)
		SELECT 'batch', 'dup-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"ok": true}', now(), now(), now(), now() + interval '30 days'
		  FROM generate_series(1, %[1]d) g;
		ANALYZE hw_batch; ANALYZE idem.processed_events;`

var batchSizes = []int{1, 10, 100, 1000}

func benchBatch(ctx context.Context, e *env, o options, t *v2table) error {
	return onServers(ctx, e, t, "batch", func(ctx context.Context, s server) error { return benchBatchOn(ctx, s, o, t) })
}

// batchCell records a comparison in keys per second: side A does perA keys
// per operation, side B perB.
func batchCell(t *v2table, metric, target, server string, c comparison, perA, perB int) {
	var ratios, as, bs []float64
	for i := range c.a {
		a, b := c.a[i].throughput()*float64(perA), c.b[i].throughput()*float64(perB)
		ratios, as, bs = append(ratios, a/b), append(as, a), append(bs, b)
	}
	t.row(metric, target).cells[server] = cell{a: median(as), b: median(bs), ratio: median(ratios), spread: spread(ratios), unit: "keys/s"}
}

func benchBatchOn(ctx context.Context, s server, o options, t *v2table) error {
	u, err := claimDatabase(ctx, s.url, "idem_bench_batch", 0, 0, 0)
	if err != nil {
		return err
	}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return err
	}
	cfg.MaxConns = 40
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, fmt.Sprintf(batchSeed+`
		CREATE TABLE batch_raw (LIKE idem.processed_events INCLUDING DEFAULTS, PRIMARY KEY (source, key));
		CREATE INDEX ON batch_raw (expires_at);
		-- The per-message pattern's table (handWritten, the e2e section's).
		CREATE TABLE hw_events (key text PRIMARY KEY, status text NOT NULL, result jsonb, at timestamptz NOT NULL DEFAULT now());
		INSERT INTO hw_events (key, status, result) SELECT 'dup-' || g, 'completed', '{"ok": true}' FROM generate_series(1, %[1]d) g;
		INSERT INTO batch_raw (source, key, first_seen_month, status, token, first_seen, updated_at, expires_at, result)
		SELECT 'batch', 'dup-' || g, idem.utc_month(now()), 'completed', g, now(), now(), now() + interval '30 days', '{"ok": true}'
		  FROM generate_series(1, %[1]d) g;
		ANALYZE hw_events; ANALYZE batch_raw`, batchDupKeys)); err != nil {
		return err
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		return err
	}
	result := batchResult
	keysOf, itemsOf, work := batchKeys, batchItems, batchWork
	keysName := map[bool]string{false: "new keys", true: "duplicates"}

	for _, clients := range o.clients {
		// SQL level, autocommit.
		for _, n := range batchSizes {
			for _, dup := range []bool{false, true} {
				batchOp := func(ctx context.Context, _ int, _ int64) error {
					rows, err := pool.Query(ctx, `SELECT ord, outcome, token FROM idem.claim_batch('batch', $1)`, keysOf(n, dup))
					if err != nil {
						return err
					}
					_, err = pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
						Ord     int32
						Outcome string
						Token   *int64
					}])
					return err
				}
				rawOp := func(ctx context.Context, _ int, _ int64) error {
					rows, err := pool.Query(ctx, `INSERT INTO batch_raw (source, key, first_seen_month, status, token, lease_expires_at, first_seen, updated_at, expires_at)
						SELECT 'batch', k, date_trunc('month', now())::date, 'processing', 1, now() + interval '2 minutes', now(), now(), now() + interval '30 days'
						  FROM unnest($1::text[]) k
						ON CONFLICT DO NOTHING RETURNING token`, keysOf(n, dup))
					if err != nil {
						return err
					}
					_, err = pgx.CollectRows(rows, pgx.RowTo[int64])
					return err
				}
				cmp, err := interleave(ctx, o.rounds, clients, o.duration, batchOp, rawOp)
				if err != nil {
					return err
				}
				target := "information"
				if n == 100 && !dup {
					target = ">= 0.50x"
				}
				batchCell(t, fmt.Sprintf("SQL: idem.claim_batch vs raw multi-row INSERT .. ON CONFLICT DO NOTHING RETURNING: %s, batch %d, %d clients", keysName[dup], n, clients),
					target, s.name, cmp, n, n)
				if n == batchSizes[len(batchSizes)/2] && !dup { // 100 in the bench
					single := func(ctx context.Context, _ int, _ int64) error {
						var outcome string
						var token *int64
						return pool.QueryRow(ctx, `SELECT outcome, token FROM idem.claim('batch', $1)`, newKey()).Scan(&outcome, &token)
					}
					cmp, err := interleave(ctx, o.rounds, clients, o.duration, batchOp, single)
					if err != nil {
						return err
					}
					batchCell(t, fmt.Sprintf("SQL: idem.claim_batch (batch %d) vs idem.claim, per key: new keys, %d clients", n, clients),
						">= 10x", s.name, cmp, n, 1)
				}
			}
		}
		// End to end.
		for _, tx := range []bool{false, true} {
			mode := map[bool]string{false: "autocommit", true: "in the caller's transaction"}[tx]
			inMode := func(fn func(db batchDB, c *idem.Client) error) error {
				if !tx {
					return fn(pool, c)
				}
				return pgx.BeginFunc(ctx, pool, func(t pgx.Tx) error { return fn(t, c.WithTx(t)) })
			}
			for _, n := range batchSizes {
				for _, dup := range []bool{false, true} {
					doBatch := func(ctx context.Context, _ int, _ int64) error {
						items := itemsOf(keysOf(n, dup))
						return inMode(func(_ batchDB, c *idem.Client) error {
							_, err := c.DoBatch(ctx, "batch", items, work)
							return err
						})
					}
					hand := func(ctx context.Context, _ int, _ int64) error {
						ks := keysOf(n, dup)
						return inMode(func(db batchDB, _ *idem.Client) error { return handWrittenBatch(ctx, db, ks) })
					}
					cmp, err := interleave(ctx, o.rounds, clients, o.duration, doBatch, hand)
					if err != nil {
						return err
					}
					target := "information"
					if n == 100 {
						target = map[bool]string{false: ">= 0.80x", true: ">= 1.0x"}[dup]
					}
					batchCell(t, fmt.Sprintf("DoBatch vs the hand-written batch pattern: %s, %s, batch %d, %d clients", keysName[dup], mode, n, clients),
						target, s.name, cmp, n, n)
					if n != 10 && n != 100 && len(batchSizes) > 1 {
						continue
					}
					perMessage := func(ctx context.Context, _ int, _ int64) error {
						ks := keysOf(n, dup)
						return inMode(func(db batchDB, _ *idem.Client) error {
							for _, k := range ks {
								if err := handWritten(ctx, db, k, func() {}); err != nil {
									return err
								}
							}
							return nil
						})
					}
					cmp, err = interleave(ctx, o.rounds, clients, o.duration, doBatch, perMessage)
					if err != nil {
						return err
					}
					target = "information"
					if n == 100 && !dup {
						target = ">= 5x"
					}
					batchCell(t, fmt.Sprintf("DoBatch vs the hand-written per-message pattern: %s, %s, batch %d, %d clients", keysName[dup], mode, n, clients),
						target, s.name, cmp, n, n)
					perKeyDo := func(ctx context.Context, _ int, _ int64) error {
						ks := keysOf(n, dup)
						return inMode(func(_ batchDB, c *idem.Client) error {
							for _, k := range ks {
								if _, err := c.Do(ctx, "batch", k, func(context.Context) (any, error) { return result, nil }); err != nil {
									return err
								}
							}
							return nil
						})
					}
					cmp, err = interleave(ctx, o.rounds, clients, o.duration, doBatch, perKeyDo)
					if err != nil {
						return err
					}
					batchCell(t, fmt.Sprintf("DoBatch vs Do per key: %s, %s, batch %d, %d clients", keysName[dup], mode, n, clients),
						"information", s.name, cmp, n, n)
				}
			}
		}
	}
	return nil
}

// batchResult is every acquired key's result.
var batchResult = json.RawMessage(`{"ok": true}`)

// batchKeys returns n new keys, or n distinct keys of the duplicates
// (batchSeed's), drawn at random.
func batchKeys(n int, dup bool) []string {
	ks := make([]string, n)
	if !dup {
		for i := range ks {
			ks[i] = newKey()
		}
		return ks
	}
	for i, j := range distinct(n, batchDupKeys) {
		ks[i] = "dup-" + strconv.Itoa(j+1)
	}
	return ks
}

func batchItems(ks []string) []idem.BatchItem {
	items := make([]idem.BatchItem, len(ks))
	for i, k := range ks {
		items[i].Key = k
	}
	return items
}

// batchWork is DoBatch's work in the bench: nothing, batchResult for each.
func batchWork(_ context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
	out := make([]idem.WorkResult, len(acquired))
	for i := range out {
		out[i].Value = batchResult
	}
	return out, nil
}

// distinct draws n distinct integers from [0, max) in random order, in
// O(n) (Floyd's algorithm): a permutation of all max per batch cost more
// of the client's CPU, on the machine the server shares, than the batch.
func distinct(n, max int) []int {
	seen := make(map[int]bool, n)
	out := make([]int, 0, n)
	for j := max - n; j < max; j++ {
		v := rand.IntN(j + 1)
		if seen[v] {
			v = j
		}
		seen[v] = true
		out = append(out, v)
	}
	rand.Shuffle(len(out), func(a, b int) { out[a], out[b] = out[b], out[a] })
	return out
}

type batchDB interface {
	QueryRow(context.Context, string, ...any) pgx.Row
	Query(context.Context, string, ...any) (pgx.Rows, error)
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}

// handWrittenBatch is the batch pattern a team writes by hand: insert every
// key first (one multi-row statement), read the stored results of those
// that were there already, do the work of the new ones, complete them in
// one UPDATE .. FROM unnest.
func handWrittenBatch(ctx context.Context, db batchDB, keys []string) error {
	rows, err := db.Query(ctx, `INSERT INTO hw_batch (key, status) SELECT k, 'processing' FROM unnest($1::text[]) k
		ON CONFLICT DO NOTHING RETURNING key`, keys)
	if err != nil {
		return err
	}
	fresh, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	if len(fresh) < len(keys) {
		isNew := make(map[string]bool, len(fresh))
		for _, k := range fresh {
			isNew[k] = true
		}
		var seen []string
		for _, k := range keys {
			if !isNew[k] {
				seen = append(seen, k)
			}
		}
		rows, err := db.Query(ctx, `SELECT key, status, result FROM hw_batch WHERE key = ANY($1::text[])`, seen)
		if err != nil {
			return err
		}
		if _, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
			Key, Status string
			Result      []byte
		}]); err != nil {
			return err
		}
	}
	if len(fresh) == 0 {
		return nil
	}
	results := make([]string, len(fresh))
	for i := range results {
		results[i] = `{"ok": true}`
	}
	_, err = db.Exec(ctx, `UPDATE hw_batch h SET status = 'completed', result = u.r::jsonb
		FROM unnest($1::text[], $2::text[]) u(k, r) WHERE h.key = u.k`, fresh, results)
	return err
}
