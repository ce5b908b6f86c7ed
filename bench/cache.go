package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// benchCache: a duplicate storm of 10000 completed keys through the Go API
// (Do), with Config.Cache (warmed) and without, each against the raw
// conflict path (INSERT .. ON CONFLICT DO NOTHING of a key that exists).
func benchCache(ctx context.Context, e *env, o options, t *table) error {
	const keys = 10000
	if _, err := e.pool.Exec(ctx, `
		INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, completed_at, expires_at)
		SELECT 'bench-cache', 'c-' || g, idem.utc_month(now()), 'completed', idem.new_token(), '{"ok": true}', now(), now(), now(), now() + interval '30 days'
		  FROM generate_series(1, $1::int) g ON CONFLICT DO NOTHING`, keys); err != nil {
		return err
	}
	key := func() string { return "c-" + strconv.Itoa(1+rand.IntN(keys)) }
	never := func(context.Context) (any, error) { return nil, fmt.Errorf("bench: a duplicate ran") }
	plain, err := idem.New(e.pool, nil)
	if err != nil {
		return err
	}
	cached, err := idem.New(e.pool, &idem.Config{Cache: &idem.CacheConfig{Size: 2 * keys, MaxAge: 5 * time.Minute}})
	if err != nil {
		return err
	}
	defer cached.Close()
	// Warm: until every key is cached (the listener starts on first use).
	for i := 1; i <= keys; i++ {
		if _, err := cached.Do(ctx, "bench-cache", "c-"+strconv.Itoa(i), never); err != nil {
			return err
		}
	}
	time.Sleep(200 * time.Millisecond)
	for i := 1; i <= keys; i++ {
		if _, err := cached.Do(ctx, "bench-cache", "c-"+strconv.Itoa(i), never); err != nil {
			return err
		}
	}
	do := func(c *idem.Client) op {
		return func(ctx context.Context, _ int, _ int64) error {
			_, err := c.Do(ctx, "bench-cache", key(), never)
			return err
		}
	}
	raw := func(ctx context.Context, _ int, _ int64) error {
		_, err := e.pool.Exec(ctx, rawInsert, "pgbench-dup", "dup-"+strconv.Itoa(1+rand.IntN(keys)))
		return err
	}
	for _, clients := range o.clients {
		for _, m := range []struct {
			name string
			c    *idem.Client
		}{{"Do without cache", plain}, {"Do with Config.Cache", cached}} {
			cmp, err := interleave(ctx, o.rounds, clients, o.duration, do(m.c), raw)
			if err != nil {
				return err
			}
			t.throughputRow("cache", fmt.Sprintf("duplicate storm: %s vs the raw conflict path, %d clients", m.name, clients), cmp, "information")
		}
	}
	return nil
}
