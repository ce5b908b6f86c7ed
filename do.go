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

// Result is what Do returns for a key whose work is done.
type Result struct {
	// Result is the stored result: what this call's work returned, or, for
	// a duplicate, what the first delivery's work returned.
	Result json.RawMessage
	// Replayed is true when the work was not run because it was done before.
	Replayed bool
	// Claim is the claim that decided this call.
	Claim *Claim
}

// Do claims (source, key), runs fn when the claim is acquired, and completes
// the key with fn's result (marshalled to JSON; a json.RawMessage or []byte
// is stored as is). For a key done before it returns the stored result
// with Replayed set, without running fn.
//
// When fn returns an error, the key is released as a retryable failure (so
// the next delivery runs fn again) and the error is returned; wrap it with
// Permanent to record a permanent failure instead. A panic in fn is
// recovered, released the same way, and returned as a *PanicError.
//
// Other answers are errors: ErrInProgress (another worker holds the lease;
// the *Result carries the claim, whose LeaseExpiresAt says when to retry),
// ErrMismatch, and *FailedError (errors.Is ErrFailed).
//
// On a pool-backed client, Do extends the lease while fn runs and cancels
// fn's context if the lease is lost. On a transaction-bound client (WithTx)
// the claim, fn's writes and the completion commit together; there is no
// heartbeat, since the transaction itself keeps duplicates waiting.
func (c *Client) Do(ctx context.Context, source, key string, fn func(ctx context.Context) (any, error), opts ...ClaimOption) (*Result, error) {
	cl, err := c.Claim(ctx, source, key, opts...)
	if err != nil {
		return nil, err
	}
	res := &Result{Claim: cl}
	switch cl.Outcome {
	case Completed:
		res.Result, res.Replayed = cl.Result, true
		return res, nil
	case InProgress:
		return res, ErrInProgress
	case Mismatch:
		return res, ErrMismatch
	case Failed:
		return res, &FailedError{Message: cl.Error}
	case Acquired:
	default:
		return res, &Error{Op: "claim", Source: source, Key: key, Kind: ErrNotMigrated,
			Err: fmt.Errorf("unexpected outcome %q", cl.Outcome)}
	}

	workCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := c.heartbeat(workCtx, cancel, cl)
	value, runErr := run(workCtx, fn)
	stop()

	if runErr != nil {
		retryable := !IsPermanent(runErr)
		// Record the failure even if ctx was cancelled: the key must not
		// stay leased until the lease runs out when we know it failed.
		fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer fcancel()
		if ferr := c.Fail(fctx, source, key, cl.Token, runErr.Error(), retryable); ferr != nil {
			c.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: could not record failure; the key is released when its lease ends",
				slog.String("source", source), slog.String("key", key), slog.Any("error", ferr))
			return res, errors.Join(runErr, ferr)
		}
		return res, runErr
	}

	raw, err := marshalResult(value)
	if err != nil {
		_ = c.Fail(context.WithoutCancel(ctx), source, key, cl.Token, err.Error(), true)
		return res, err
	}
	if err := c.Complete(ctx, source, key, cl.Token, raw); err != nil {
		if errors.Is(err, ErrStaleToken) {
			return res, fmt.Errorf("%w: %w", ErrLeaseLost, err)
		}
		return res, err
	}
	res.Result = raw
	return res, nil
}

// run calls fn, turning a panic into a *PanicError.
func run(ctx context.Context, fn func(ctx context.Context) (any, error)) (v any, err error) {
	defer func() {
		if p := recover(); p != nil {
			v, err = nil, &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return fn(ctx)
}

func marshalResult(v any) (json.RawMessage, error) {
	switch r := v.(type) {
	case nil:
		return nil, nil
	case json.RawMessage:
		return r, nil
	case []byte:
		return json.RawMessage(r), nil
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, &Error{Op: "complete", Kind: ErrInvalidInput, Err: fmt.Errorf("marshal result: %w", err)}
	}
	return b, nil
}

// heartbeat extends the lease while the work runs; it returns a function
// that stops it and waits for it to finish.
func (c *Client) heartbeat(ctx context.Context, cancel context.CancelCauseFunc, cl *Claim) func() {
	if !c.d.concurrent() || c.cfg.HeartbeatFraction < 0 || cl.LeaseExpiresAt.IsZero() {
		return func() {}
	}
	lease := cl.lease // the caller's WithLease, or 0 for the source's policy
	span := lease
	if span == 0 {
		span = time.Until(cl.LeaseExpiresAt)
	}
	every := time.Duration(float64(span) * c.cfg.HeartbeatFraction)
	if every < 100*time.Millisecond {
		every = 100 * time.Millisecond
	}
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
				_, err := c.Extend(ctx, cl.Source, cl.Key, cl.Token, lease)
				switch {
				case err == nil:
				case errors.Is(err, ErrStaleToken), errors.Is(err, ErrNotFound):
					cancel(ErrLeaseLost)
					return
				case ctx.Err() == nil:
					c.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: lease heartbeat failed; will retry",
						slog.String("source", cl.Source), slog.String("key", cl.Key), slog.Any("error", err))
				}
			}
		}
	}()
	return func() { close(done); <-stopped }
}
