package main

import (
	"context"
	"embed"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
)

// The ceiling section (opt-in: -only ceiling) bounds what any version of
// the batch protocol could reach against the batch section's hand-written
// batch pattern on idem's table. It replaces idem.claim_batch (and
// idem.complete_batch) in a second database by the least that could still
// answer (ceiling/*.sql: experiments that drop guarantees the protocol
// keeps, never migrations), and runs DoBatch of 100 keys there against
// the functions as shipped in another database on the same server, and
// against the hand-written batch, interleaved, from the first client
// count (8 by default), autocommit and in the caller's transaction.
//
// Before those, the floor (issue 55): the shipped single-key idem.claim
// and completion against the least a claim and a completion can do on
// idem.processed_events (ceiling/floor.sql: bench_floor_claim and
// bench_floor_complete, in a database of their own with the completion
// trigger off), and that floor against the raw baselines of the claim
// section, through pgbench like the claim section.

//go:embed ceiling/*.sql
var ceilingSQL embed.FS

var ceilingExperiments = []struct {
	name  string
	files []string
	dup   bool // duplicates (keys completed before the run) or new keys
}{
	{"claim_batch reduced to one probe of each key", []string{"probe_only.sql"}, true},
	{"claim_batch reduced to the locks and the insert", []string{"claim_bare.sql"}, false},
	{"claim_batch and complete_batch reduced to their writes", []string{"claim_bare.sql", "complete_bare.sql"}, false},
	{"both reduced to their writes, the completion trigger off", []string{"claim_bare.sql", "complete_bare.sql", "no_trigger.sql"}, false},
}

const ceilingBatch = 100

func benchCeiling(ctx context.Context, e *env, o options, t, floor *v2table) error {
	defer func() { floor.servers = t.servers }()
	return onServers(ctx, e, t, "ceiling", func(ctx context.Context, s server) error { return benchCeilingOn(ctx, s, o, t, floor) })
}

// floorDatabases creates, on s, the shipped database (the claim section's
// steady state: 9 monthly partitions) and the floor's, a copy of it, and
// returns their URLs.
func floorDatabases(ctx context.Context, s server) (shipped, floor string, err error) {
	if shipped, err = claimDatabase(ctx, s.url, "idem_bench_floor_shipped", 0, 5, 0); err != nil {
		return "", "", err
	}
	admin, err := pgx.Connect(ctx, s.url)
	if err != nil {
		return "", "", err
	}
	defer admin.Close(ctx)
	for _, q := range []string{`DROP DATABASE IF EXISTS idem_bench_floor WITH (FORCE)`, `CREATE DATABASE idem_bench_floor TEMPLATE idem_bench_floor_shipped`} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return "", "", err
		}
	}
	if floor, err = databaseURL(s.url, "idem_bench_floor"); err != nil {
		return "", "", err
	}
	conn, err := pgx.Connect(ctx, floor)
	if err != nil {
		return "", "", err
	}
	defer conn.Close(ctx)
	for _, f := range []string{"floor.sql", "no_trigger.sql"} {
		b, err := ceilingSQL.ReadFile("ceiling/" + f)
		if err != nil {
			return "", "", err
		}
		if _, err := conn.Exec(ctx, string(b)); err != nil {
			return "", "", fmt.Errorf("%s: %w", f, err)
		}
	}
	return shipped, floor, nil
}

// benchFloorOn fills the floor table on s.
func benchFloorOn(ctx context.Context, s server, o options, t *v2table) error {
	shipped, floor, err := floorDatabases(ctx, s)
	if err != nil {
		return err
	}
	clients := o.clients[0]
	for _, r := range []struct {
		metric, target string
		a, b           pgbenchSide
	}{
		{"idem.claim vs the minimal claim: new keys", "information (the floor)",
			pgbenchSide{script: "claim_new.sql", url: shipped}, pgbenchSide{script: "floor_new.sql", url: floor}},
		{"idem.claim vs the minimal claim: duplicates of completed keys", "information (the floor)",
			pgbenchSide{script: "claim_dup.sql", url: shipped}, pgbenchSide{script: "floor_dup.sql", url: floor}},
		{"claim and completion (idem.claim, idem.complete_stored: what Do sends) vs the minimal claim and completion: new keys", "information (the floor)",
			pgbenchSide{script: "do_new.sql", url: shipped}, pgbenchSide{script: "floor_do_new.sql", url: floor}},
		{"the minimal claim vs raw INSERT .. ON CONFLICT DO NOTHING (plain table): new keys", "information (idem.claim's target: >= 0.65x)",
			pgbenchSide{script: "floor_new.sql", url: floor}, pgbenchSide{script: "raw_insert.sql", url: floor}},
		{"the minimal claim vs the raw conflict path: duplicates of completed keys", "information (idem.claim's target: >= 0.50x)",
			pgbenchSide{script: "floor_dup.sql", url: floor}, pgbenchSide{script: "raw_dup.sql", url: floor}},
		{"the minimal claim and completion vs the hand-written insert-first pattern (hand_new.sql): new keys", "information",
			pgbenchSide{script: "floor_do_new.sql", url: floor}, pgbenchSide{script: "hand_new.sql", url: floor}},
	} {
		c, err := pgbenchCompare(ctx, s, o, r.a, r.b, clients)
		if err != nil {
			return fmt.Errorf("floor: %s: %w", r.metric, err)
		}
		t.row(fmt.Sprintf("%s, %d clients", r.metric, clients), r.target).cells[s.name] = c
	}
	return nil
}

// ceilingDatabase creates name migrated, with the batch section's
// duplicates and hand-written table, with the experiment's files applied.
func ceilingDatabase(ctx context.Context, s server, name string, files []string) (*pgxpool.Pool, *idem.Client, error) {
	u, err := claimDatabase(ctx, s.url, name, 0, 0, 0)
	if err != nil {
		return nil, nil, err
	}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return nil, nil, err
	}
	cfg.MaxConns = 40
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, nil, err
	}
	stmts := []string{fmt.Sprintf(batchSeed, batchDupKeys)}
	for _, f := range files {
		b, err := ceilingSQL.ReadFile("ceiling/" + f)
		if err != nil {
			pool.Close()
			return nil, nil, err
		}
		stmts = append(stmts, string(b))
	}
	for _, q := range stmts {
		if _, err := pool.Exec(ctx, q); err != nil {
			pool.Close()
			return nil, nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		pool.Close()
		return nil, nil, err
	}
	return pool, c, nil
}

func benchCeilingOn(ctx context.Context, s server, o options, t, floor *v2table) error {
	if err := benchFloorOn(ctx, s, o, floor); err != nil {
		return err
	}
	shipped, cs, err := ceilingDatabase(ctx, s, "idem_bench_ceiling_shipped", nil)
	if err != nil {
		return err
	}
	defer shipped.Close()
	clients := o.clients[0]
	for _, x := range ceilingExperiments {
		pool, c, err := ceilingDatabase(ctx, s, "idem_bench_ceiling_experiment", x.files)
		if err != nil {
			return err
		}
		keys, target := "new keys", "information (target >= 0.80x)"
		if x.dup {
			keys, target = "duplicates", "information (target >= 1.0x)"
		}
		for _, tx := range []bool{false, true} {
			mode := map[bool]string{false: "autocommit", true: "in the caller's transaction"}[tx]
			inMode := func(pool *pgxpool.Pool, c *idem.Client, fn func(db batchDB, c *idem.Client) error) error {
				if !tx {
					return fn(pool, c)
				}
				return pgx.BeginFunc(ctx, pool, func(t pgx.Tx) error { return fn(t, c.WithTx(t)) })
			}
			doBatch := func(pool *pgxpool.Pool, c *idem.Client) op {
				return func(ctx context.Context, _ int, _ int64) error {
					items := batchItems(batchKeys(ceilingBatch, x.dup))
					return inMode(pool, c, func(_ batchDB, c *idem.Client) error {
						_, err := c.DoBatch(ctx, "batch", items, batchWork)
						return err
					})
				}
			}
			hand := func(ctx context.Context, _ int, _ int64) error {
				ks := batchKeys(ceilingBatch, x.dup)
				return inMode(pool, c, func(db batchDB, _ *idem.Client) error { return handWrittenBatch(ctx, db, ks) })
			}
			cmp, err := interleave(ctx, o.rounds, clients, o.duration, doBatch(pool, c), doBatch(shipped, cs))
			if err != nil {
				pool.Close()
				return fmt.Errorf("%s, %s, against the functions as shipped: %w", x.name, mode, err)
			}
			batchCell(t, fmt.Sprintf("ceiling: DoBatch, %s, vs as shipped: %s, %s, batch %d, %d clients", x.name, keys, mode, ceilingBatch, clients),
				"information", s.name, cmp, ceilingBatch, ceilingBatch)
			cmp, err = interleave(ctx, o.rounds, clients, o.duration, doBatch(pool, c), hand)
			if err != nil {
				pool.Close()
				return fmt.Errorf("%s, %s, against the hand-written batch: %w", x.name, mode, err)
			}
			batchCell(t, fmt.Sprintf("ceiling: DoBatch, %s, vs the hand-written batch pattern: %s, %s, batch %d, %d clients", x.name, keys, mode, ceilingBatch, clients),
				target, s.name, cmp, ceilingBatch, ceilingBatch)
		}
		pool.Close()
	}
	return nil
}
