package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"
)

// benchPlans: what the claim's relation locks cost. The claim runs its
// statements as generic plans (plan_cache_mode = force_generic_plan), and
// PostgreSQL 13-17 lock every partition and index of a generic plan at
// executor start, past the 16 fast-path slots with 9 monthly partitions.
// Compared, on the same server, duplicates and new keys at 8 and 32
// clients: the claim as shipped against (a) the same claim with custom
// plans (only the partitions the key's months need are locked; each call
// plans its statements) and (b) the same claim over 4 partitions instead
// of 9 (+ the default). Information for #28: what was tried.
func benchPlans(ctx context.Context, e *env, o options, t *table) error {
	mk := func(name string, past int, custom bool) (*pgxpool.Pool, error) {
		u, err := claimDatabase(ctx, e.url, name, 0, past, 0)
		if err != nil {
			return nil, err
		}
		cfg, err := pgxpool.ParseConfig(u)
		if err != nil {
			return nil, err
		}
		cfg.MaxConns = 40
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return nil, err
		}
		if _, err := pool.Exec(ctx, fmt.Sprintf(`
			INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, completed_at, expires_at)
			SELECT 'plans', 'dup-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"ok": true}', now(), now(), now(), now() + interval '30 days'
			  FROM generate_series(1, %d) g`, e2eDupKeys)); err != nil {
			pool.Close()
			return nil, err
		}
		if custom {
			if _, err := pool.Exec(ctx, `ALTER FUNCTION idem.claim(text, text, text, interval, interval, text, interval) SET plan_cache_mode = force_custom_plan`); err != nil {
				pool.Close()
				return nil, err
			}
		}
		return pool, nil
	}
	shipped, err := mk("idem_bench_plans_generic", 5, false)
	if err != nil {
		return err
	}
	defer shipped.Close()
	custom, err := mk("idem_bench_plans_custom", 5, true)
	if err != nil {
		return err
	}
	defer custom.Close()
	fewer, err := mk("idem_bench_plans_fewer", 0, false)
	if err != nil {
		return err
	}
	defer fewer.Close()
	claim := func(pool *pgxpool.Pool, dup bool) op {
		return func(ctx context.Context, _ int, _ int64) error {
			key := newKey()
			if dup {
				key = "dup-" + strconv.Itoa(1+rand.IntN(e2eDupKeys))
			}
			var outcome string
			return pool.QueryRow(ctx, `SELECT outcome FROM idem.claim('plans', $1)`, key).Scan(&outcome)
		}
	}
	for _, clients := range o.clients {
		for _, dup := range []bool{true, false} {
			keys := map[bool]string{true: "duplicates", false: "new keys"}[dup]
			for _, v := range []struct {
				name string
				pool *pgxpool.Pool
			}{{"custom plans (force_custom_plan)", custom}, {"4 partitions instead of 9", fewer}} {
				cmp, err := interleave(ctx, o.rounds, clients, o.duration, claim(v.pool, dup), claim(shipped, dup))
				if err != nil {
					return err
				}
				t.throughputRow("plans", fmt.Sprintf("claim with %s vs as shipped (generic plans, 9 partitions): %s, %d clients", v.name, keys, clients), cmp, "information: #28")
			}
		}
	}
	return nil
}
