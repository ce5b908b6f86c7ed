package idem

import (
	"context"
	"database/sql"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// A batch claim on a distributed (Citus) installation, where
// idem.claim_batch refuses (ID006: a per-key lock excludes only the claims
// of the node it is taken on). The batch's keys are grouped by the node
// that holds them (idem.citus_batch_routes, one round trip), and each
// group is claimed on its node by idem.citus_claim_batch, which Citus
// delegates there by the group's key: one call per node, pipelined in one
// round trip with pgx (its implicit transaction spans the nodes; Citus
// commits it on them in two phases). On the node, each shard's keys are
// claimed by the shard's copy of idem.claim_batch, shard after shard
// (docs/citus.md, "Batch claims").

// citusRoutes returns the batch's groups: a key of each group and the
// positions (from 1) of its items.
const citusRoutes = `SELECT key, ords FROM idem.citus_batch_routes($1::text::text[])`

// citusClaimBatch is ClaimBatch's query (db/queries) on idem.citus_claim_batch,
// its first argument the group's key, a parameter: Citus delegates the call
// by it. The arrays are text[] parameters (Citus cannot send a delegated
// call's text::text[] casts to the node: "cannot cast type cstring to
// text[]"). Its timestamps are microseconds since the epoch, as
// ClaimBatch's.
const citusClaimBatch = `SELECT c.ord::integer, c.outcome::text, coalesce(c.token, 0)::bigint, coalesce(c.attempt, 0)::integer,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.lease_expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint, c.result::jsonb, coalesce(c.error, '')::text,
       coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.first_seen) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint, coalesce(pg_catalog.round(pg_catalog.date_part('epoch', c.expires_at) OPERATOR(pg_catalog.*) 1000000::double precision), 0)::bigint,
       coalesce(pg_catalog.floor(pg_catalog.date_part('epoch', c.lease_remaining) OPERATOR(pg_catalog.*) 1000::double precision), 0)::bigint
  FROM idem.citus_claim_batch($1::text, $2::text, $3::text[], $4::text[],
         $5::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond', $6::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond',
         $7::text[], $8::bigint::double precision OPERATOR(pg_catalog.*) interval '1 millisecond') AS c`

// citusGroup is one node's part of a batch.
type citusGroup struct {
	key  string
	ords []int32 // positions in the batch, from 1
}

// args are the group's arguments of citusClaimBatch.
func (g citusGroup) args(a batchArgs) []any {
	keys := make([]string, len(g.ords))
	var fps, types []*string // nil: NULL, no array
	for i, o := range g.ords {
		it := a.items[o-1]
		keys[i] = it.Key
		if it.Fingerprint != "" {
			if fps == nil {
				fps = make([]*string, len(g.ords))
			}
			fps[i] = &it.Fingerprint
		}
		if it.EventType != "" {
			if types == nil {
				types = make([]*string, len(g.ords))
			}
			types[i] = &it.EventType
		}
	}
	return []any{g.key, a.source, keys, fps, msPtr(a.ttl), msPtr(a.lease), types, waitMs(a.lockWait)}
}

// citusRow is one row of citusClaimBatch.
type citusRow struct {
	ord                          int32
	outcome, errText             string
	token, leaseMs               int64
	attempt                      int32
	result                       []byte
	leaseExp, firstSeen, expires int64 // microseconds since the epoch (usTime)
}

func (r *citusRow) dest() []any {
	return []any{&r.ord, &r.outcome, &r.token, &r.attempt, &r.leaseExp, &r.result, &r.errText, &r.firstSeen, &r.expires, &r.leaseMs}
}

// place puts r, an answer of group g, at its item's position.
func (r *citusRow) place(a batchArgs, g citusGroup, out []*Claim, seen []bool) bool {
	if r.ord < 1 || int(r.ord) > len(g.ords) {
		return false
	}
	ord := g.ords[r.ord-1]
	cl := &Claim{
		Outcome: Outcome(r.outcome), Source: a.source, Key: a.items[ord-1].Key,
		Token: r.token, Attempt: int(r.attempt),
		LeaseExpiresAt: usTime(r.leaseExp), Result: json.RawMessage(r.result),
		Error: r.errText, FirstSeen: usTime(r.firstSeen), ExpiresAt: usTime(r.expires),
		LeaseRemaining: time.Duration(r.leaseMs) * time.Millisecond,
	}
	return inOrder(out, seen, ord, cl)
}

// batcher is what pipelines the groups' calls: *pgxpool.Pool, *pgx.Conn
// and pgx.Tx.
type batcher interface {
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}

func (d pgxDriver) claimBatchCitus(ctx context.Context, a batchArgs) ([]*Claim, error) {
	keys, _, _ := batchArrays(a.items)
	groups, err := pgxRetry(d, func() ([]citusGroup, error) {
		rows, err := d.db.Query(ctx, citusRoutes, keys)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, func(r pgx.CollectableRow) (g citusGroup, err error) {
			err = r.Scan(&g.key, &g.ords)
			return g, err
		})
	})
	if err != nil {
		return nil, err
	}
	out, seen := make([]*Claim, len(a.items)), make([]bool, len(a.items))
	read := func(g citusGroup, rows pgx.Rows) error {
		defer rows.Close()
		for rows.Next() {
			var r citusRow
			if err := rows.Scan(r.dest()...); err != nil {
				return err
			}
			if !r.place(a, g, out, seen) {
				out = nil
			}
		}
		return rows.Err()
	}
	if b, ok := d.db.(batcher); ok {
		batch := &pgx.Batch{}
		for _, g := range groups {
			batch.Queue(citusClaimBatch, g.args(a)...)
		}
		res := b.SendBatch(ctx, batch)
		for _, g := range groups {
			rows, err := res.Query()
			if err == nil {
				err = read(g, rows)
			}
			if err != nil {
				res.Close()
				return nil, err
			}
		}
		if err := res.Close(); err != nil {
			return nil, err
		}
	} else {
		for _, g := range groups {
			rows, err := d.db.Query(ctx, citusClaimBatch, g.args(a)...)
			if err == nil {
				err = read(g, rows)
			}
			if err != nil {
				return nil, err
			}
		}
	}
	if out == nil {
		return nil, nil
	}
	return answered(out, seen), nil
}

// claimBatchCitus with database/sql: one call per node, one after another
// (in the caller's transaction, if any).
func (d sqlDriver) claimBatchCitus(ctx context.Context, a batchArgs) ([]*Claim, error) {
	keys, _, _ := batchArrays(a.items)
	groups, err := sqlRetry(d, func() ([]citusGroup, error) {
		rows, err := d.db.QueryContext(ctx, citusRoutes, keys)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		var gs []citusGroup
		for rows.Next() {
			var g citusGroup
			var ords pgtype.FlatArray[int32]
			if err := rows.Scan(&g.key, pgtype.NewMap().SQLScanner(&ords)); err != nil {
				return nil, err
			}
			g.ords = ords
			gs = append(gs, g)
		}
		return gs, rows.Err()
	})
	if err != nil {
		return nil, err
	}
	out, seen := make([]*Claim, len(a.items)), make([]bool, len(a.items))
	for _, g := range groups {
		if err := func() error {
			args := g.args(a)
			for i, v := range args { // database/sql: NULL as nil
				if p, ok := v.(*int64); ok && p == nil {
					args[i] = nil
				} else if p, ok := v.([]*string); ok && p == nil {
					args[i] = nil
				}
			}
			rows, err := d.db.QueryContext(ctx, citusClaimBatch, args...)
			if err != nil {
				return err
			}
			defer rows.Close()
			for rows.Next() {
				var r citusRow
				var res sql.RawBytes
				dest := r.dest()
				dest[5] = &res
				if err := rows.Scan(dest...); err != nil {
					return err
				}
				if res != nil {
					r.result = append([]byte(nil), res...)
				}
				if !r.place(a, g, out, seen) {
					out = nil
				}
			}
			return rows.Err()
		}(); err != nil {
			return nil, err
		}
	}
	if out == nil {
		return nil, nil
	}
	return answered(out, seen), nil
}

func (d pgxDriver) distributed(ctx context.Context) (bool, error) {
	installed, err := pgxRetry(d, func() (bool, error) { return d.q.CitusInstalled(ctx) })
	if err != nil || !installed {
		return false, err
	}
	return pgxRetry(d, func() (bool, error) { return d.q.Distributed(ctx) })
}

func (d sqlDriver) distributed(ctx context.Context) (bool, error) {
	installed, err := sqlRetry(d, func() (bool, error) { return d.q.CitusInstalled(ctx) })
	if err != nil || !installed {
		return false, err
	}
	return sqlRetry(d, func() (bool, error) { return d.q.Distributed(ctx) })
}

// completeEachCitus and failEachCitus are CompleteBatch's and FailBatch's
// calls on Citus, where idem.complete_batch and idem.fail_batch cannot be
// planned (their items join the distributed table: "could not create
// distributed plan"): each item by its own call (idem.complete_stored,
// idem.fail), which Citus delegates to its key's node; in the caller's
// transaction, if any, else each on its own.
func completeEachCitus(ctx context.Context, d driver, source string, items []Completion) (outs, stored []string, err error) {
	outs, stored = make([]string, len(items)), make([]string, len(items))
	for i, it := range items {
		o, st, err := d.complete(ctx, source, it.Key, it.Token, it.Result, true)
		if err != nil {
			return nil, nil, err
		}
		outs[i], stored[i] = o, string(st)
	}
	return outs, stored, nil
}

func failEachCitus(ctx context.Context, d driver, source string, items []Failure) ([]string, error) {
	outs := make([]string, len(items))
	for i, it := range items {
		o, err := d.fail(ctx, source, it.Key, it.Token, it.Message, it.Retryable)
		if err != nil {
			return nil, err
		}
		outs[i] = o
	}
	return outs, nil
}

// citus reports whether idem is distributed (Citus), as batchReady found.
func (c *Client) citus() bool { return c.schema != nil && c.schema.citus.Load() }
