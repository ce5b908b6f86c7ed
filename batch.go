package idem

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
)

// MaxBatch is the most items ClaimBatch, DoBatch, CompleteBatch and
// FailBatch take in one call. A batch claim holds one lock per distinct key
// until its transaction ends, in the server's shared lock table
// (max_locks_per_transaction × (max_connections +
// max_prepared_transactions) entries): the limit bounds one batch's share
// (docs/queues.md). More is refused with ErrBatchTooLarge, before anything
// is claimed.
const MaxBatch = 1000

// BatchItem is one key of a batch claim.
type BatchItem struct {
	Key string
	// Fingerprint of this item's request (see WithFingerprint); "" for
	// none, or the batch's WithFingerprint.
	Fingerprint string
	// EventType of this item (see WithEventType); "" for none, or the
	// batch's WithEventType.
	EventType string
}

// ClaimBatch claims the items' keys of one source in one round trip and
// returns one *Claim per item, in the order of items. Each item gets the
// answer Claim gives its key, with the same guarantees (the per-key lock,
// holds, adoption, the source's policy, counting; READ COMMITTED or
// SERIALIZABLE, REPEATABLE READ refused): Acquired with its own token,
// Completed with its result, InProgress, Mismatch or Failed. A key that
// appears twice is answered, the second time, as a duplicate of the first
// (InProgress when the first acquired it). The keys are locked in one
// global order, so batches that overlap never wait on each other in a
// cycle.
//
// Options apply to every item: WithTTL, WithLease, WithLockWait (one
// deadline for the whole batch: a key whose claim is inside another open
// transaction is waited for until it passes, and then answered
// InProgress); WithFingerprint and WithEventType give the items that set
// none theirs. WithWait is refused (ErrInvalidInput): call Claim with it
// for the keys that answered InProgress.
//
// The whole batch is refused, and nothing claimed, for a batch of more than
// MaxBatch items (ErrBatchTooLarge), an item PostgreSQL text cannot hold or
// out of idem's bounds (ErrInvalidInput; the *Error names the key and the
// message its position), a source without policy (ErrUnknownPolicy), and on
// a distributed (Citus) installation (ErrBatchNotSupported). With
// Config.Cache, each item is first looked up in the cache; only the others
// go to the database. Config.Observer is told each item's claim, with
// ClaimObservation.Batch set.
func (c *Client) ClaimBatch(ctx context.Context, source string, items []BatchItem, opts ...ClaimOption) ([]*Claim, error) {
	if c.tr == nil {
		return c.claimBatch(ctx, source, items, opts)
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpClaimBatch, Source: source, Batch: len(items)})
	cls, err := c.claimBatch(ctx, source, items, opts)
	end := TraceEndData{Op: OpClaimBatch, Source: source, Err: err, Batch: len(items)}
	if err == nil {
		end.Claims = cls
	}
	c.traceEnd(ctx, start, end)
	return cls, err
}

// batchArgs are a batch claim's arguments after option processing.
type batchArgs struct {
	claimArgs // source, ttl, lease, lock wait; fingerprint and event type: the items' default
	items     []BatchItem
}

func (c *Client) claimBatch(ctx context.Context, source string, items []BatchItem, opts []ClaimOption) ([]*Claim, error) {
	a := batchArgs{claimArgs: claimArgs{source: source, lockWait: c.wait}}
	for _, o := range opts {
		o(&a.claimArgs)
	}
	if a.wait != 0 {
		return nil, &Error{Op: "claim", Source: source, Kind: ErrInvalidInput,
			Err: errorString("WithWait is not supported by a batch claim: claim the keys that answered InProgress with Claim")}
	}
	if err := checkBatch("claim", source, len(items)); err != nil {
		return nil, err
	}
	a.items = make([]BatchItem, len(items))
	for i, it := range items {
		if it.Fingerprint == "" {
			it.Fingerprint = a.fingerprint
		}
		if it.EventType == "" {
			it.EventType = a.eventType
		}
		if err := checkText("claim", source, it.Key, it.Fingerprint, it.EventType); err != nil {
			e := err.(*Error)
			e.Err = fmt.Errorf("item %d: %w", i, e.Err)
			return nil, e
		}
		a.items[i] = it
	}
	if err := c.checkWait(&a.claimArgs); err != nil {
		return nil, err
	}
	if err := c.batchReady(ctx, source); err != nil {
		return nil, err
	}

	out := make([]*Claim, len(items))
	// The items the cache cannot answer, and their positions.
	ask, pos := a.items, []int(nil)
	var gen uint64
	cached := c.cache != nil && c.hub.fresh()
	if cached {
		gen = c.cache.generation()
		ask = nil
		for i, it := range a.items {
			if cl, ok := c.cache.get(source, it.Key, it.Fingerprint); ok {
				out[i] = cl
				cctx, start := c.traceStart(ctx, TraceStartData{Op: OpCache, Source: source, Key: it.Key})
				c.traceEnd(cctx, start, TraceEndData{Op: OpCache, Source: source, Key: it.Key, Claim: cl})
				continue
			}
			ask, pos = append(ask, it), append(pos, i)
		}
		if len(ask) == 0 {
			return out, nil
		}
	}
	q := a
	q.items = ask
	var cls []*Claim
	var err error
	if c.citus() {
		cls, err = c.d.claimBatchCitus(ctx, q)
	} else {
		cls, err = c.d.claimBatch(ctx, q)
	}
	if err != nil {
		err = convert("claim", source, "", err)
		c.forgetSchema(err)
		return nil, err
	}
	if len(cls) != len(ask) {
		return nil, &Error{Op: "claim", Source: source, Kind: ErrNotMigrated,
			Err: fmt.Errorf("idem.claim_batch answered %d rows for %d keys", len(cls), len(ask))}
	}
	put := cached && c.hub.fresh()
	if put && c.inTx {
		// As Claim: only what another transaction committed, read with a
		// snapshot per statement, goes to the cache.
		if put, err = c.d.cacheable(ctx); err != nil {
			return nil, convert("claim", source, "", err)
		}
	}
	for j, cl := range cls {
		i := j
		if pos != nil {
			i = pos[j]
		}
		out[i] = cl
		if put && cl.Outcome == Completed {
			c.cache.put(source, cl.Key, a.items[i].Fingerprint, cl, gen)
		}
	}
	return out, nil
}

// checkBatch refuses an empty batch and one over MaxBatch.
func checkBatch(op, source string, n int) error {
	switch {
	case n == 0:
		return &Error{Op: op, Source: source, Kind: ErrInvalidInput, Err: errorString("the batch is empty")}
	case n > MaxBatch:
		return &Error{Op: op, Source: source, Kind: ErrBatchTooLarge,
			Err: fmt.Errorf("%d items, over MaxBatch (%d): split the batch", n, MaxBatch)}
	}
	return nil
}

// Completion is one item of CompleteBatch.
type Completion struct {
	Key    string
	Token  int64
	Result json.RawMessage // JSON; nil stores SQL NULL
}

// CompleteBatch completes the items of one source in one round trip, as
// Complete completes each: it returns one error per item (nil when
// completed, ErrStaleToken, ErrNotFound), or an error for the whole batch
// (nothing completed): more than MaxBatch items, an item whose key cannot
// be sent or whose result cannot be stored (ErrInvalidInput,
// ErrResultTooLarge: the *Error names the key), a database error.
func (c *Client) CompleteBatch(ctx context.Context, source string, items []Completion) ([]error, error) {
	_, errs, err := c.completeBatch(ctx, source, items, false)
	return errs, err
}

// completeBatch is CompleteBatch; with echo it also returns each result as
// stored.
func (c *Client) completeBatch(ctx context.Context, source string, items []Completion, echo bool) ([]json.RawMessage, []error, error) {
	if err := checkBatch("complete", source, len(items)); err != nil {
		return nil, nil, err
	}
	risky := false
	for i, it := range items {
		if err := c.check("complete", source, it.Key); err != nil {
			e := err.(*Error)
			e.Err = fmt.Errorf("item %d: %w", i, e.Err)
			return nil, nil, e
		}
		if err := CheckResult(it.Result); err != nil {
			e := err.(*Error)
			e.Source, e.Key, e.Err = source, it.Key, fmt.Errorf("item %d: %w", i, e.Err)
			return nil, nil, e
		}
		risky = risky || len(it.Result) > mayExceedLimit
	}
	var outs, stored []string
	err := c.d.guard(ctx, risky, func() (err error) {
		if c.citus() {
			outs, stored, err = completeEachCitus(ctx, c.d, source, items)
		} else {
			outs, stored, err = c.d.completeBatch(ctx, source, items)
		}
		return err
	})
	if err != nil {
		err = convert("complete", source, "", err)
		c.forgetSchema(err)
		return nil, nil, err
	}
	if len(outs) != len(items) {
		return nil, nil, &Error{Op: "complete", Source: source, Kind: ErrNotMigrated,
			Err: fmt.Errorf("idem.complete_batch answered %d rows for %d items", len(outs), len(items))}
	}
	errs := make([]error, len(items))
	var res []json.RawMessage
	if echo {
		res = make([]json.RawMessage, len(items))
	}
	for i, out := range outs {
		errs[i] = outcomeErr("complete", source, items[i].Key, out)
		if echo && items[i].Result != nil {
			res[i] = json.RawMessage(stored[i])
		}
	}
	return res, errs, nil
}

// Failure is one item of FailBatch.
type Failure struct {
	Key       string
	Token     int64
	Message   string
	Retryable bool
}

// FailBatch records the failures of the items of one source in one round
// trip, as Fail records each: one error per item (nil when recorded,
// ErrStaleToken, ErrNotFound), or an error for the whole batch.
func (c *Client) FailBatch(ctx context.Context, source string, items []Failure) ([]error, error) {
	if err := checkBatch("fail", source, len(items)); err != nil {
		return nil, err
	}
	for i, it := range items {
		if err := c.check("fail", source, it.Key); err != nil {
			e := err.(*Error)
			e.Err = fmt.Errorf("item %d: %w", i, e.Err)
			return nil, e
		}
	}
	var outs []string
	var err error
	if c.citus() {
		outs, err = failEachCitus(ctx, c.d, source, items)
	} else {
		outs, err = c.d.failBatch(ctx, source, items)
	}
	if err != nil {
		err = convert("fail", source, "", err)
		c.forgetSchema(err)
		return nil, err
	}
	if len(outs) != len(items) {
		return nil, &Error{Op: "fail", Source: source, Kind: ErrNotMigrated,
			Err: fmt.Errorf("idem.fail_batch answered %d rows for %d items", len(outs), len(items))}
	}
	errs := make([]error, len(items))
	for i, out := range outs {
		errs[i] = outcomeErr("fail", source, items[i].Key, out)
	}
	return errs, nil
}

// pgArray writes n elements as a PostgreSQL array literal (text), element
// i from elem, NULL where elem says so: the protocol's arrays travel as
// text, which every driver sends as it is. Elements hold no NUL byte
// (checked before).
func pgArray(n int, elem func(i int) (s string, null bool)) string {
	var b strings.Builder
	b.WriteByte('{')
	for i := range n {
		if i > 0 {
			b.WriteByte(',')
		}
		s, null := elem(i)
		if null {
			b.WriteString("NULL")
			continue
		}
		b.WriteByte('"')
		for j := 0; j < len(s); j++ {
			if s[j] == '"' || s[j] == '\\' {
				b.WriteByte('\\')
			}
			b.WriteByte(s[j])
		}
		b.WriteByte('"')
	}
	b.WriteByte('}')
	return b.String()
}

// batchArrays are a batch claim's arrays as literals; fingerprints and
// eventTypes are "" when no item has one (SQL NULL: no array).
func batchArrays(items []BatchItem) (keys, fingerprints, eventTypes string) {
	keys = pgArray(len(items), func(i int) (string, bool) { return items[i].Key, false })
	for _, it := range items {
		if it.Fingerprint != "" && fingerprints == "" {
			fingerprints = pgArray(len(items), func(i int) (string, bool) {
				return items[i].Fingerprint, items[i].Fingerprint == ""
			})
		}
		if it.EventType != "" && eventTypes == "" {
			eventTypes = pgArray(len(items), func(i int) (string, bool) {
				return items[i].EventType, items[i].EventType == ""
			})
		}
	}
	return keys, fingerprints, eventTypes
}

// completionArrays are CompleteBatch's arrays as literals.
func completionArrays(items []Completion) (keys, tokens, results string) {
	keys = pgArray(len(items), func(i int) (string, bool) { return items[i].Key, false })
	tokens = pgArray(len(items), func(i int) (string, bool) { return fmt.Sprint(items[i].Token), false })
	results = pgArray(len(items), func(i int) (string, bool) { return string(items[i].Result), items[i].Result == nil })
	return keys, tokens, results
}

// failureArrays are FailBatch's arrays as literals; messages are made
// storable as Fail makes them.
func failureArrays(items []Failure) (keys, tokens, messages, retryable string) {
	keys = pgArray(len(items), func(i int) (string, bool) { return items[i].Key, false })
	tokens = pgArray(len(items), func(i int) (string, bool) { return fmt.Sprint(items[i].Token), false })
	messages = pgArray(len(items), func(i int) (string, bool) { return StorableText(items[i].Message), false })
	retryable = pgArray(len(items), func(i int) (string, bool) { return fmt.Sprint(items[i].Retryable), false })
	return keys, tokens, messages, retryable
}
