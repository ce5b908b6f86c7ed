package idem

import (
	"context"
	"encoding/json"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/db/sqldb"
)

// The batch protocol calls of the two drivers (migration 18). Each answers
// rows in no particular order, with ord the item's position from 1; they
// come back in the items' order.

// pgxRetry runs one protocol call of many rows and, when the pooler refused
// its prepared statement (which switches the client to exec mode), sends it
// once more outside a transaction, as modeRow does for one row.
func pgxRetry[T any](d pgxDriver, call func() (T, error)) (T, error) {
	v, err := call()
	if err != nil && d.mode != nil && d.mode.adapt(err) {
		if _, inTx := d.db.(pgx.Tx); !inTx {
			return call()
		}
	}
	return v, err
}

// inOrder places row r (ord from 1) at its item's position; false when ord
// is out of range or seen twice (a function not the one this package was
// built for: the caller's length check reports it).
func inOrder[T any](out []T, seen []bool, ord int32, v T) bool {
	i := int(ord) - 1
	if i < 0 || i >= len(out) || seen[i] {
		return false
	}
	out[i], seen[i] = v, true
	return true
}

func (d pgxDriver) claimBatch(ctx context.Context, a batchArgs) ([]*Claim, error) {
	keys, fps, types := batchArrays(a.items)
	rows, err := pgxRetry(d, func() ([]pgxdb.ClaimBatchRow, error) {
		return d.q.ClaimBatch(ctx, pgxdb.ClaimBatchParams{
			Source: a.source, Keys: keys, Fingerprints: strPtr(fps), EventTypes: strPtr(types),
			TtlMs: msPtr(a.ttl), LeaseMs: msPtr(a.lease), LockWaitMs: waitMs(a.lockWait),
		})
	})
	if err != nil {
		return nil, err
	}
	out, seen := make([]*Claim, len(a.items)), make([]bool, len(a.items))
	for _, row := range rows {
		i := int(row.Ord) - 1
		if i < 0 || i >= len(out) {
			return nil, nil
		}
		cl := &Claim{
			Outcome: Outcome(row.Outcome), Source: a.source, Key: a.items[i].Key,
			Token: row.Token, Attempt: int(row.Attempt),
			LeaseExpiresAt: usTime(row.LeaseExpiresAtUs), Result: json.RawMessage(row.Result),
			Error: row.Error, FirstSeen: usTime(row.FirstSeenUs), ExpiresAt: usTime(row.ExpiresAtUs),
			LeaseRemaining: time.Duration(row.LeaseRemainingMs) * time.Millisecond,
		}
		if !inOrder(out, seen, row.Ord, cl) {
			return nil, nil
		}
	}
	return answered(out, seen), nil
}

func (d pgxDriver) completeBatch(ctx context.Context, source string, items []Completion) ([]string, []string, error) {
	keys, tokens, results := completionArrays(items)
	rows, err := pgxRetry(d, func() ([]pgxdb.CompleteBatchRow, error) {
		return d.q.CompleteBatch(ctx, pgxdb.CompleteBatchParams{Source: source, Keys: keys, Tokens: tokens, Results: results})
	})
	if err != nil {
		return nil, nil, err
	}
	outs, stored, seen := make([]string, len(items)), make([]string, len(items)), make([]bool, len(items))
	for _, row := range rows {
		if !inOrder(outs, seen, row.Ord, row.Outcome) {
			return nil, nil, nil
		}
		stored[row.Ord-1] = row.Stored
	}
	return answered(outs, seen), stored, nil
}

func (d pgxDriver) failBatch(ctx context.Context, source string, items []Failure) ([]string, error) {
	keys, tokens, msgs, retryable := failureArrays(items)
	rows, err := pgxRetry(d, func() ([]pgxdb.FailBatchRow, error) {
		return d.q.FailBatch(ctx, pgxdb.FailBatchParams{Source: source, Keys: keys, Tokens: tokens, Errors: msgs, Retryable: retryable})
	})
	if err != nil {
		return nil, err
	}
	outs, seen := make([]string, len(items)), make([]bool, len(items))
	for _, row := range rows {
		if !inOrder(outs, seen, row.Ord, row.Outcome) {
			return nil, nil
		}
	}
	return answered(outs, seen), nil
}

func (d sqlDriver) claimBatch(ctx context.Context, a batchArgs) ([]*Claim, error) {
	keys, fps, types := batchArrays(a.items)
	rows, err := sqlRetry(d, func() ([]sqldb.ClaimBatchRow, error) {
		return d.q.ClaimBatch(ctx, sqldb.ClaimBatchParams{
			Source: a.source, Keys: keys, Fingerprints: nullStr(fps), EventTypes: nullStr(types),
			TtlMs: nullMs(a.ttl), LeaseMs: nullMs(a.lease), LockWaitMs: nullInt(waitMs(a.lockWait)),
		})
	})
	if err != nil {
		return nil, err
	}
	out, seen := make([]*Claim, len(a.items)), make([]bool, len(a.items))
	for _, row := range rows {
		i := int(row.Ord) - 1
		if i < 0 || i >= len(out) {
			return nil, nil
		}
		cl := &Claim{
			Outcome: Outcome(row.Outcome), Source: a.source, Key: a.items[i].Key,
			Token: row.Token, Attempt: int(row.Attempt),
			LeaseExpiresAt: usTime(row.LeaseExpiresAtUs), Error: row.Error,
			FirstSeen: usTime(row.FirstSeenUs), ExpiresAt: usTime(row.ExpiresAtUs),
			LeaseRemaining: time.Duration(row.LeaseRemainingMs) * time.Millisecond,
		}
		if row.Result.Valid {
			cl.Result = row.Result.RawMessage
		}
		if !inOrder(out, seen, row.Ord, cl) {
			return nil, nil
		}
	}
	return answered(out, seen), nil
}

func (d sqlDriver) completeBatch(ctx context.Context, source string, items []Completion) ([]string, []string, error) {
	keys, tokens, results := completionArrays(items)
	rows, err := sqlRetry(d, func() ([]sqldb.CompleteBatchRow, error) {
		return d.q.CompleteBatch(ctx, sqldb.CompleteBatchParams{Source: source, Keys: keys, Tokens: tokens, Results: results})
	})
	if err != nil {
		return nil, nil, err
	}
	outs, stored, seen := make([]string, len(items)), make([]string, len(items)), make([]bool, len(items))
	for _, row := range rows {
		if !inOrder(outs, seen, row.Ord, row.Outcome) {
			return nil, nil, nil
		}
		stored[row.Ord-1] = row.Stored
	}
	return answered(outs, seen), stored, nil
}

func (d sqlDriver) failBatch(ctx context.Context, source string, items []Failure) ([]string, error) {
	keys, tokens, msgs, retryable := failureArrays(items)
	rows, err := sqlRetry(d, func() ([]sqldb.FailBatchRow, error) {
		return d.q.FailBatch(ctx, sqldb.FailBatchParams{Source: source, Keys: keys, Tokens: tokens, Errors: msgs, Retryable: retryable})
	})
	if err != nil {
		return nil, err
	}
	outs, seen := make([]string, len(items)), make([]bool, len(items))
	for _, row := range rows {
		if !inOrder(outs, seen, row.Ord, row.Outcome) {
			return nil, nil
		}
	}
	return answered(outs, seen), nil
}

// answered returns out when every position was answered, else nil (the
// callers' length check then reports the function's answer as not the
// one this package was built for).
func answered[T any](out []T, seen []bool) []T {
	for _, ok := range seen {
		if !ok {
			return nil
		}
	}
	return out
}
