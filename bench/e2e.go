package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/idemkit/idem"
)

// The end-to-end section: the whole Do, as a user compares it, against what
// they would otherwise write or use, through the same pgx pool:
//
//   - the hand-written insert-first pattern of the field notes: INSERT ..
//     ON CONFLICT DO NOTHING RETURNING; on a conflict, a SELECT of the
//     stored result; after the work, an UPDATE with the result;
//   - River's unique jobs: one unique insert per event (by args).
//
// Both modes: autocommit (Do on the pool: claim, work, complete; the
// pattern's statements each in their own transaction; River's Insert) and
// inside the caller's transaction (BEGIN, claim, work, complete, COMMIT;
// the same for the pattern; River's InsertTx). New keys and duplicates
// (keys completed before the run), no-op work and 1 ms of work, 8 and 32
// goroutines, median of interleaved rounds, on a durable server and with
// fsync off.
//
// Round trips per Do: new key, autocommit: 2 (claim, complete); in a
// transaction: 4 (BEGIN, claim, complete, COMMIT); duplicate: 1 (claim),
// or 3 in a transaction. The pattern: new key 2 or 4 the same way;
// duplicate 2 (INSERT, SELECT) or 4.

const e2eDupKeys = 10000

type e2eArgs struct {
	Key string `json:"key" river:"unique"`
}

func (e2eArgs) Kind() string { return "bench_e2e" }

// benchE2E fills the end-to-end table on each server.
func benchE2E(ctx context.Context, e *env, o options, t *v2table) error {
	return onServers(ctx, e, t, "e2e", func(ctx context.Context, s server) error { return benchE2EOn(ctx, s, o, t) })
}

func benchE2EOn(ctx context.Context, s server, o options, t *v2table) error {
	u, err := claimDatabase(ctx, s.url, "idem_bench_e2e", 0, 0, 0)
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
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return err
	}
	rc, err := river.NewClient(riverpgxv5.New(pool), &river.Config{SkipUnknownJobCheck: true, Logger: quietLogger()})
	if err != nil {
		return err
	}
	// Duplicates: the same keys completed before the run, in each store.
	if _, err := pool.Exec(ctx, fmt.Sprintf(`
		CREATE TABLE hw_events (key text PRIMARY KEY, status text NOT NULL, result jsonb, at timestamptz NOT NULL DEFAULT now());
		INSERT INTO hw_events (key, status, result) SELECT 'dup-' || g, 'completed', '{"ok": true}' FROM generate_series(1, %[1]d) g;
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, completed_at, expires_at)
		SELECT 'e2e', 'dup-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"ok": true}', now(), now(), now(), now() + interval '30 days'
		  FROM generate_series(1, %[1]d) g;
		ANALYZE hw_events`, e2eDupKeys)); err != nil {
		return err
	}
	for i := 1; i <= e2eDupKeys; i++ {
		if _, err := rc.Insert(ctx, e2eArgs{Key: "dup-" + strconv.Itoa(i)}, nil); err != nil {
			return err
		}
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		return err
	}
	// The same client with its cache of completed outcomes (Config.Cache,
	// docs/design.md): a duplicate of a key completed within MaxAge is
	// answered from memory while the cache's listener is heard from.
	cached, err := idem.New(pool, &idem.Config{Cache: &idem.CacheConfig{Size: e2eDupKeys}})
	if err != nil {
		return err
	}
	defer cached.Close()
	result := json.RawMessage(`{"ok": true}`)
	keyOf := func(dup bool) string {
		if dup {
			return "dup-" + strconv.Itoa(1+rand.IntN(e2eDupKeys))
		}
		return newKey()
	}
	type mode struct {
		name string
		tx   bool
	}
	for _, clients := range o.clients {
		for _, work := range []time.Duration{0, time.Millisecond} {
			doWork := func() {
				if work > 0 {
					time.Sleep(work)
				}
			}
			for _, md := range []mode{{"autocommit", false}, {"in the caller's transaction", true}} {
				for _, dup := range []bool{false, true} {
					// doWith is the whole Do through c, in this mode.
					doWith := func(c *idem.Client) func(ctx context.Context, _ int, _ int64) error {
						return func(ctx context.Context, _ int, _ int64) error {
							key := keyOf(dup)
							fn := func(context.Context) (any, error) { doWork(); return result, nil }
							if !md.tx {
								_, err := c.Do(ctx, "e2e", key, fn)
								return err
							}
							return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
								_, err := c.WithTx(tx).Do(ctx, "e2e", key, fn)
								return err
							})
						}
					}
					do := doWith(c)
					hand := func(ctx context.Context, _ int, _ int64) error {
						key := keyOf(dup)
						if !md.tx {
							return handWritten(ctx, pool, key, doWork)
						}
						return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return handWritten(ctx, tx, key, doWork) })
					}
					keys := "new keys"
					if dup {
						keys = "duplicates"
					}
					w := "no-op work"
					if work > 0 {
						w = "1 ms of work"
					}
					var ws *waitSampler
					if clients >= 32 && work == 0 {
						ws = sampleWaits(ctx, pool)
					}
					cmp, err := interleave(ctx, o.rounds, clients, o.duration, do, hand)
					if err != nil {
						return err
					}
					if ws != nil {
						ws.stop(fmt.Sprintf("%s, Do and the hand-written pattern, %s, %s, %d clients", s.name, keys, md.name, clients))
					}
					target := "information"
					if work == 0 {
						target = map[bool]string{false: ">= 0.80x", true: ">= 1.0x"}[dup]
					}
					putCell(t, fmt.Sprintf("Do vs the hand-written pattern: %s, %s, %s, %d clients", keys, md.name, w, clients), target, s.name, cmp, "ops/s")
					if work > 0 {
						continue
					}
					if dup {
						cmp, err := interleave(ctx, o.rounds, clients, o.duration, doWith(cached), hand)
						if err != nil {
							return err
						}
						putCell(t, fmt.Sprintf("Do with Config.Cache vs the hand-written pattern: duplicates, %s, no-op work, %d clients", md.name, clients),
							">= 1.0x", s.name, cmp, "ops/s")
					}
					riverOp := func(ctx context.Context, _ int, _ int64) error {
						args := e2eArgs{Key: keyOf(dup)}
						if !md.tx {
							_, err := rc.Insert(ctx, args, nil)
							return err
						}
						return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
							_, err := rc.InsertTx(ctx, tx, args, nil)
							return err
						})
					}
					cmp, err = interleave(ctx, o.rounds, clients, o.duration, do, riverOp)
					if err != nil {
						return err
					}
					putCell(t, fmt.Sprintf("Do vs River's unique insert: %s, %s, no-op work, %d clients", keys, md.name, clients), "> 1.0x", s.name, cmp, "ops/s")
				}
			}
		}
	}
	// The SQL-level gap in the same table and run: the claim alone through
	// pgbench (simple protocol: parsed and planned at every call, unlike
	// the Go API's prepared statements) against the raw statements.
	for _, r := range []struct {
		metric, sa, sb string
		clients        int
	}{
		{"SQL level (pgbench): idem.claim of new keys vs raw INSERT .. ON CONFLICT DO NOTHING (plain table), %d clients", "claim_new.sql", "raw_insert.sql", 8},
		{"SQL level (pgbench): idem.claim of new keys vs raw INSERT .. ON CONFLICT DO NOTHING (plain table), %d clients", "claim_new.sql", "raw_insert.sql", 32},
		{"SQL level (pgbench): idem.claim of duplicates vs the raw conflict path, %d clients", "claim_dup.sql", "raw_dup.sql", 8},
		{"SQL level (pgbench): idem.claim of duplicates vs the raw conflict path, %d clients", "claim_dup.sql", "raw_dup.sql", 32},
	} {
		if err := pgbenchRow(ctx, s, o, t, fmt.Sprintf(r.metric, r.clients), "information", r.sa, u, r.sb, u, r.clients); err != nil {
			return err
		}
	}
	return nil
}

// handWritten is the field notes' insert-first pattern on db (a pool, or
// the caller's transaction).
func handWritten(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, key string, work func()) error {
	var k string
	err := db.QueryRow(ctx, `INSERT INTO hw_events (key, status) VALUES ($1, 'processing') ON CONFLICT DO NOTHING RETURNING key`, key).Scan(&k)
	if errors.Is(err, pgx.ErrNoRows) {
		var res []byte
		return db.QueryRow(ctx, `SELECT result FROM hw_events WHERE key = $1`, key).Scan(&res)
	}
	if err != nil {
		return err
	}
	work()
	_, err = db.Exec(ctx, `UPDATE hw_events SET status = 'completed', result = $2 WHERE key = $1`, key, `{"ok": true}`)
	return err
}

// putCell records a comparison as one cell of the table.
func putCell(t *v2table, metric, target, server string, c comparison, unit string) {
	var ratios, as, bs []float64
	for i := range c.a {
		ratios = append(ratios, c.a[i].throughput()/c.b[i].throughput())
		as, bs = append(as, c.a[i].throughput()), append(bs, c.b[i].throughput())
	}
	t.row(metric, target).cells[server] = cell{a: median(as), b: median(bs), ratio: median(ratios), spread: spread(ratios), unit: unit}
}
