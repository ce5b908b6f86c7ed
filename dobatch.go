package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"time"
)

// WorkResult is the outcome of one acquired item of DoBatch's work.
type WorkResult struct {
	// Value is the item's result, stored as Do stores its work's value.
	Value any
	// Err fails this item only: released for a retry, or recorded as a
	// permanent failure when wrapped with Permanent; wrapped with Momentary,
	// released without counting the attempt, as Do releases its key.
	Err error
}

// BatchWork is DoBatch's work: it runs once, over the items the batch
// acquired (in the order of the batch; never empty), and returns one
// WorkResult per acquired item, in the same order. An error, a panic or a
// slice of the wrong length fails every acquired item with it (released
// for a retry, permanent when the error is wrapped with Permanent, or
// released without counting the attempt when it is wrapped with
// Momentary).
type BatchWork func(ctx context.Context, acquired []*Claim) ([]WorkResult, error)

// BatchResult is DoBatch's answer for one item: what Do returns for its
// key.
type BatchResult struct {
	Result
	// Err is the error Do would return for the key: ErrInProgress,
	// ErrMismatch, a *FailedError, the work's error for the item (the key
	// was released or failed), ErrLeaseLost, ErrResultNotStored, or the
	// error of the recording call.
	Err error
}

// DoBatch is Do for a batch of keys of one source (a queue consumer's
// fetch): it claims every item in one call (ClaimBatch), runs fn once over
// the acquired items, and records their outcomes in one call per kind
// (completed, failed; a Momentary failure is released as Do releases one,
// a call per key). It returns one BatchResult per item, in the order of
// items: a key done before is replayed (Result, with Replayed set) without
// running fn; the other answers are the errors Do returns.
//
// fn works over the acquired subset, not per item, so that it can write
// the effects of the whole batch in one statement or one transaction.
// fn's context belongs to no one event, nor to any effect of an event
// whose work started the batch: attach an item's claim with WithEvent to
// run that item's effects (Client.Effect). Its
// per-item errors fail only their item: the other items are completed.
//
// The returned error is for the whole batch: the claim failed (nothing was
// claimed; see ClaimBatch), or the outcomes could not be recorded (each
// item's Err says so too). On a pool, recording is detached from ctx and
// retried as Do's is, and the acquired keys' leases are extended while fn
// runs (an item whose lease is lost is not completed: its Err is
// ErrLeaseLost; fn's context is not cancelled for the others). In the
// caller's transaction (WithTx, WithSQLTx), the claims, fn's writes and the
// records commit or roll back together, and the caller decides: commit
// keeps the completed items and releases the failed ones; rollback undoes
// the whole batch.
func (c *Client) DoBatch(ctx context.Context, source string, items []BatchItem, fn BatchWork, opts ...ClaimOption) ([]BatchResult, error) {
	sent := time.Now()
	cls, err := c.ClaimBatch(ctx, source, items, opts...)
	if err != nil {
		return nil, err
	}
	res := make([]BatchResult, len(items))
	var acquired []*Claim
	var at []int // positions of acquired in items
	for i, cl := range cls {
		res[i].Claim = cl
		switch cl.Outcome {
		case Acquired:
			acquired, at = append(acquired, cl), append(at, i)
		default:
			res[i].Result, res[i].Err = answer(source, cl)
		}
	}
	if len(acquired) == 0 {
		return res, nil
	}

	lost := make([]bool, len(acquired))
	stop := c.batchHeartbeat(ctx, acquired, lost, sent)
	// The batch's work belongs to no one event (WithEvent names an item's),
	// nor to any effect of an event whose work started the batch.
	results, runErr := runBatch(withScope(ctx, nil, nil), fn, acquired)
	stop()

	var done []Completion
	var doneAt []int // positions in acquired
	var failed []Failure
	var failedAt []int
	var momentary []int // positions in acquired of momentary failures
	var notJSON []int   // positions in acquired of values that are not JSON
	for j, cl := range acquired {
		i := at[j]
		r := results[j]
		if runErr != nil {
			r = WorkResult{Err: runErr}
		}
		if r.Err == nil {
			raw, err := marshalResult(r.Value)
			if err != nil {
				// A value that is not JSON: the work ran; recorded below
				// as Do records it (completed without a result).
				res[i].Err, notJSON = err, append(notJSON, j)
				continue
			}
			done, doneAt = append(done, Completion{Key: cl.Key, Token: cl.Token, Result: raw}), append(doneAt, j)
			continue
		}
		if lost[j] {
			r.Err = leaseLost(r.Err)
		}
		res[i].Err = r.Err
		if !IsPermanent(r.Err) && IsMomentary(r.Err) {
			momentary = append(momentary, j)
			continue
		}
		failed, failedAt = append(failed, Failure{Key: cl.Key, Token: cl.Token, Message: r.Err.Error(),
			Retryable: !IsPermanent(r.Err)}), append(failedAt, j)
	}

	var recErr error
	// Momentary failures: each key released without counting the attempt,
	// by the call Do makes for its one key (idem.fail with retryable NULL;
	// one round trip per key, since idem.fail_batch counts every failure it
	// records).
	for _, j := range momentary {
		cl, i := acquired[j], at[j]
		err := c.record(ctx, source, cl.Key, func(ctx context.Context) error {
			return c.FailMomentary(ctx, source, cl.Key, cl.Token, res[i].Err.Error())
		})
		switch {
		case err == nil:
		case errors.Is(err, ErrStaleToken), errors.Is(err, ErrNotFound):
			// Another worker took the key over (its lease was lost).
			if !errors.Is(res[i].Err, ErrLeaseLost) {
				res[i].Err = errors.Join(res[i].Err, err)
			}
		default:
			res[i].Err = errors.Join(res[i].Err, err)
			recErr = errors.Join(recErr, err)
		}
	}
	if len(failed) > 0 {
		var errs []error
		err := c.record(ctx, source, "", func(ctx context.Context) (err error) {
			errs, err = c.FailBatch(ctx, source, failed)
			return err
		})
		for k, j := range failedAt {
			i := at[j]
			switch {
			case err != nil:
				res[i].Err = errors.Join(res[i].Err, err)
			case errs[k] != nil && !errors.Is(res[i].Err, ErrLeaseLost):
				res[i].Err = errors.Join(res[i].Err, errs[k])
			}
		}
		recErr = err
	}
	if len(done) > 0 {
		var stored []json.RawMessage
		var errs []error
		err := c.record(ctx, source, "", func(ctx context.Context) (err error) {
			stored, errs, err = c.completeBatch(ctx, source, done, true)
			return err
		})
		if err != nil && unstorable(err) {
			// One result cannot be stored (over the limit, not storable
			// JSON): the batch call refused them all. Complete each item on
			// its own, as Do does, so the others keep their results.
			stored, errs, err = c.completeEach(ctx, source, done)
		}
		for k, j := range doneAt {
			i := at[j]
			switch {
			case err != nil:
				res[i].Err = err
			case errors.Is(errs[k], ErrStaleToken):
				res[i].Err = leaseLost(errs[k])
			case errs[k] != nil:
				res[i].Err = errs[k]
				var e *Error
				if errors.As(errs[k], &e) && e.Kind == ErrResultNotStored {
					res[i].NotStored = "result not stored: " + e.Err.Error()
				}
			default:
				res[i].Result.Result = stored[k]
			}
		}
		if err != nil {
			recErr = errors.Join(recErr, err)
		}
	}
	// Values that were not JSON: the work ran; completed without a result.
	for _, j := range notJSON {
		cl, i := acquired[j], at[j]
		cause := res[i].Err
		if uerr := c.record(ctx, source, cl.Key, func(ctx context.Context) error {
			return c.CompleteUnstored(ctx, source, cl.Key, cl.Token, cause.Error())
		}); uerr != nil {
			res[i].Err = errors.Join(cause, uerr)
			recErr = errors.Join(recErr, uerr)
			continue
		}
		res[i].NotStored = "result not stored: " + cause.Error()
		res[i].Err = &Error{Op: "complete", Source: source, Key: cl.Key, Kind: ErrResultNotStored, Err: cause}
	}
	if recErr != nil && c.d.concurrent() {
		c.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: a batch's work ran but its outcomes could not be recorded; its keys run again after their leases end",
			slog.String("source", source), slog.Int("acquired", len(acquired)), slog.Any("error", recErr))
	}
	return res, recErr
}

// answer is Do's answer for a claim that did not acquire its key.
func answer(source string, cl *Claim) (Result, error) {
	res := Result{Claim: cl}
	switch cl.Outcome {
	case Completed:
		res.Result, res.Replayed = cl.Result, true
		if cl.Result == nil && cl.Error != "" {
			res.NotStored = cl.Error
		}
		return res, nil
	case InProgress:
		return res, ErrInProgress
	case Mismatch:
		return res, ErrMismatch
	case Failed:
		return res, &FailedError{Message: cl.Error}
	}
	return res, &Error{Op: "claim", Source: source, Key: cl.Key, Kind: ErrNotMigrated,
		Err: fmt.Errorf("unexpected outcome %q", cl.Outcome)}
}

// runBatch calls fn, turning a panic into a *PanicError and a result of the
// wrong length into an error for every item.
func runBatch(ctx context.Context, fn BatchWork, acquired []*Claim) (results []WorkResult, err error) {
	results, err = func() (r []WorkResult, err error) {
		defer func() {
			if p := recover(); p != nil {
				r, err = nil, &PanicError{Value: p, Stack: debug.Stack()}
			}
		}()
		return fn(ctx, acquired)
	}()
	if err == nil && len(results) != len(acquired) {
		err = fmt.Errorf("idem: DoBatch's work returned %d results for %d acquired items", len(results), len(acquired))
	}
	if err != nil {
		results = make([]WorkResult, len(acquired))
	}
	return results, err
}

// completeEach completes the items one by one (Do's way), when the batch
// holds a result that cannot be stored: such an item is completed without
// its result and answers ErrResultNotStored.
func (c *Client) completeEach(ctx context.Context, source string, items []Completion) ([]json.RawMessage, []error, error) {
	stored := make([]json.RawMessage, len(items))
	errs := make([]error, len(items))
	for k, it := range items {
		err := c.record(ctx, source, it.Key, func(ctx context.Context) (err error) {
			stored[k], err = c.complete(ctx, source, it.Key, it.Token, it.Result, true)
			return err
		})
		if err != nil && unstorable(err) {
			cause := err
			err = c.record(ctx, source, it.Key, func(ctx context.Context) error {
				return c.CompleteUnstored(ctx, source, it.Key, it.Token, cause.Error())
			})
			if err == nil {
				err = &Error{Op: "complete", Source: source, Key: it.Key, Kind: ErrResultNotStored, Err: cause}
			}
		}
		errs[k] = err
	}
	return stored, errs, nil
}

// batchHeartbeat keeps the leases of a batch's acquired keys while its work
// runs (on a pool), as heartbeat keeps one: one goroutine extends each key
// in turn every lease*HeartbeatFraction (the shortest lease granted), timed
// by this process's monotonic clock from sent, so a batch of 1,000 keys
// holds at most one of the pool's connections for it. A key whose lease is
// lost is marked in lost (read after the returned function has stopped
// it), and the work goes on for the others.
func (c *Client) batchHeartbeat(ctx context.Context, acquired []*Claim, lost []bool, sent time.Time) func() {
	var lease time.Duration
	for _, cl := range acquired {
		if cl.LeaseRemaining > 0 && (lease == 0 || cl.LeaseRemaining < lease) {
			lease = cl.LeaseRemaining
		}
	}
	if !c.d.concurrent() || c.cfg.HeartbeatFraction < 0 || lease <= 0 {
		return func() {}
	}
	every := max(time.Duration(float64(lease)*c.cfg.HeartbeatFraction), 50*time.Millisecond)
	bctx := context.WithoutCancel(ctx)
	return beatEvery(every, sent, func(done <-chan struct{}) (time.Time, bool) {
		next := time.Now().Add(every)
		for j, cl := range acquired {
			select {
			case <-done:
				return time.Time{}, true
			default:
			}
			if lost[j] {
				continue
			}
			switch gone, retry := c.beat(bctx, cl, cl.LeaseRemaining, every); {
			case gone:
				lost[j] = true
				c.cfg.Logger.LogAttrs(bctx, slog.LevelWarn, "idem: lease lost while the batch's work runs",
					slog.String("source", cl.Source), slog.String("key", cl.Key))
			case retry:
				// Try again soon, as heartbeat does.
				next = time.Now().Add(max(every/4, 50*time.Millisecond))
			}
		}
		return next, false
	})
}
