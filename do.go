package idem

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"sync"
	"time"
)

// Result is what Do returns for a key whose work is done.
type Result struct {
	// Result is the stored result, the same bytes for the call whose work
	// ran and for every duplicate: the work's value as JSON in jsonb's text
	// form (PostgreSQL normalizes white space, key order and duplicate
	// keys; `{"b":1,"a":[1,2]}` reads back as `{"a": [1, 2], "b": 1}`).
	// nil when the work returned nil or its result could not be stored
	// (see NotStored).
	Result json.RawMessage
	// Replayed is true when the work was not run because it was done before.
	Replayed bool
	// NotStored, for a key whose work ran but whose result could not be
	// stored, says why (and Result is nil on replays).
	NotStored string
	// Claim is the claim that decided this call.
	Claim *Claim
}

// Do claims (source, key), runs fn when the claim is acquired, and completes
// the key with fn's result (marshalled to JSON; a json.RawMessage or []byte
// is stored as is). For a key done before it returns the stored result
// with Replayed set, without running fn.
//
// Once fn has returned, its outcome is recorded whatever happens to ctx:
// recording is detached from ctx's cancellation and, on a pool, transient
// errors are retried with backoff for up to Config.RecordTimeout. A result
// that cannot be stored (over 1 MiB, not JSON, a NUL character) still
// completes the key, without a result, so a duplicate is answered as done
// instead of running fn again; Do then returns an error matching
// ErrResultNotStored and the cause.
//
// When fn returns an error, the key is released as a retryable failure (so
// the next delivery runs fn again) and the error is returned; wrap it with
// Permanent to record a permanent failure instead, or with Momentary to
// release the key without counting the attempt. A panic in fn is
// recovered, released the same way, and returned as a *PanicError.
//
// Other answers are errors: ErrInProgress (another worker holds the lease;
// the *Result carries the claim, whose LeaseRemaining says when to retry),
// ErrMismatch, and *FailedError (errors.Is ErrFailed).
//
// fn's context carries the claim (EventFrom), so that the side effects fn
// runs with Effect belong to this key, and no effect of an event whose
// work called Do (EffectFrom reports none until fn calls Effect): a write
// fn sends through idemhttp.Transport is never keyed by an enclosing
// effect.
//
// On a pool-backed client, Do extends the lease while fn runs, until fn
// returns even if ctx is cancelled (fn may ignore its context; its lease
// must not lapse while it still runs), and cancels fn's context with
// ErrLeaseLost if the lease is lost. On a transaction-bound client
// (WithTx) the claim, fn's writes and the completion commit together;
// there is no heartbeat, since the transaction itself keeps duplicates
// waiting (up to the claim's lock wait).
func (c *Client) Do(ctx context.Context, source, key string, fn func(ctx context.Context) (any, error), opts ...ClaimOption) (*Result, error) {
	if c.tr == nil {
		return c.do(ctx, source, key, fn, opts)
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpDo, Source: source, Key: key})
	res, err := c.do(ctx, source, key, fn, opts)
	end := TraceEndData{Op: OpDo, Source: source, Key: key, Err: err}
	if res != nil {
		end.Claim, end.Replayed = res.Claim, res.Replayed
	}
	c.traceEnd(ctx, start, end)
	return res, err
}

// do is Do, untraced (Effect traces it as its own operation).
func (c *Client) do(ctx context.Context, source, key string, fn func(ctx context.Context) (any, error), opts []ClaimOption) (*Result, error) {
	sent := time.Now() // the lease starts no earlier than this, by our clock
	cl, err := c.Claim(ctx, source, key, opts...)
	if err != nil {
		return nil, err
	}
	res := &Result{Claim: cl}
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
	case Acquired:
	default:
		return res, &Error{Op: "claim", Source: source, Key: key, Kind: ErrNotMigrated,
			Err: fmt.Errorf("unexpected outcome %q", cl.Outcome)}
	}

	workCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := c.heartbeat(workCtx, cancel, cl, sent)
	value, runErr := c.run(WithEvent(workCtx, cl), fn)
	stop()
	if runErr != nil && errors.Is(context.Cause(workCtx), ErrLeaseLost) {
		runErr = leaseLost(runErr)
	}

	if runErr != nil {
		retryable := !IsPermanent(runErr)
		if ferr := c.record(ctx, source, key, func(ctx context.Context) error {
			if retryable && IsMomentary(runErr) {
				return c.FailMomentary(ctx, source, key, cl.Token, runErr.Error())
			}
			return c.Fail(ctx, source, key, cl.Token, runErr.Error(), retryable)
		}); ferr != nil && !errors.Is(runErr, ErrLeaseLost) {
			c.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: could not record failure; the key is released when its lease ends",
				slog.String("source", source), slog.String("key", key), slog.Any("error", ferr))
			return res, errors.Join(runErr, ferr)
		}
		return res, runErr
	}

	raw, err := marshalResult(value)
	if err == nil {
		var stored json.RawMessage
		err = c.record(ctx, source, key, func(ctx context.Context) (err error) {
			stored, err = c.complete(ctx, source, key, cl.Token, raw, true)
			return err
		})
		if err == nil {
			res.Result = stored
			return res, nil
		}
	}
	if errors.Is(err, ErrStaleToken) {
		return res, leaseLost(err)
	}
	if !unstorable(err) {
		if c.d.concurrent() {
			// Not recorded within RecordTimeout: the key stays processing
			// until its lease ends, and then runs again (docs/design.md).
			c.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idem: the work ran but could not be recorded; it will run again after the lease ends",
				slog.String("source", source), slog.String("key", key), slog.Any("error", err))
		}
		// In the caller's transaction, the claim and the work's writes roll
		// back with it: the caller sees the error and retries.
		return res, err
	}
	// The work ran and its result cannot be stored: complete the key
	// without it, so that duplicates are told it is done.
	uerr := c.record(ctx, source, key, func(ctx context.Context) error {
		return c.CompleteUnstored(ctx, source, key, cl.Token, err.Error())
	})
	if uerr != nil {
		if errors.Is(uerr, ErrStaleToken) {
			uerr = leaseLost(uerr)
		}
		return res, errors.Join(err, uerr)
	}
	res.NotStored = "result not stored: " + err.Error()
	return res, &Error{Op: "complete", Source: source, Key: key, Kind: ErrResultNotStored, Err: err}
}

// leaseLost marks err as the consequence of a lost lease (once).
func leaseLost(err error) error {
	if errors.Is(err, ErrLeaseLost) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrLeaseLost, err)
}

// unstorable reports an error of a result that can never be stored.
func unstorable(err error) bool {
	return errors.Is(err, ErrInvalidInput) || errors.Is(err, ErrResultTooLarge)
}

// record runs one recording call (complete or fail) detached from ctx's
// cancellation, bounded by RecordTimeout. On a pool it retries transient
// errors with jittered exponential backoff; inside a transaction a failed
// statement has aborted the transaction, so there is one attempt.
func (c *Client) record(ctx context.Context, source, key string, call func(ctx context.Context) error) error {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cfg.RecordTimeout)
	defer cancel()
	pause := 25 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := call(rctx)
		if err == nil || !c.d.concurrent() || !transient(err) || rctx.Err() != nil {
			if err != nil && attempt > 1 && errors.Is(err, ErrStaleToken) {
				// An earlier attempt may have gone through before its
				// answer was lost, and another worker acquired the key since.
				err = fmt.Errorf("%w (after %d attempts; an earlier one may have been recorded)", err, attempt)
			}
			return err
		}
		c.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: recording failed; retrying",
			slog.String("source", source), slog.String("key", key), slog.Int("attempt", attempt), slog.Any("error", err))
		wait := pause/2 + rand.N(pause/2+1)
		pause = min(pause*2, 2*time.Second)
		t := time.NewTimer(wait)
		select {
		case <-rctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// run calls fn (traced as OpWork), turning a panic into a *PanicError.
func (c *Client) run(ctx context.Context, fn func(ctx context.Context) (any, error)) (v any, err error) {
	if c.tr != nil {
		cl, _ := EventFrom(ctx)
		var start time.Time
		ctx, start = c.traceStart(ctx, TraceStartData{Op: OpWork, Source: cl.Source, Key: cl.Key, Name: "work"})
		defer func() { c.traceEnd(ctx, start, TraceEndData{Op: OpWork, Source: cl.Source, Key: cl.Key, Err: err}) }()
	}
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
	case typedValue:
		v = r.v
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, &Error{Op: "complete", Kind: ErrInvalidInput, Err: fmt.Errorf("marshal result: %w", err)}
	}
	return b, nil
}

// heartbeat extends the lease while the work runs; it returns a function
// that stops it and waits for it to finish. It is timed by this process's
// monotonic clock from the lease length the database granted, counted from
// before the request that was granted it, so a skewed clock on either side
// cannot make it late. It keeps going when ctx is cancelled (the work may
// not stop) and ends only when the work returns or the lease is lost.
func (c *Client) heartbeat(ctx context.Context, cancel context.CancelCauseFunc, cl *Claim, sent time.Time) func() {
	lease := cl.LeaseRemaining
	if !c.d.concurrent() || c.cfg.HeartbeatFraction < 0 || lease <= 0 {
		return func() {}
	}
	every := max(time.Duration(float64(lease)*c.cfg.HeartbeatFraction), 50*time.Millisecond)
	bctx := context.WithoutCancel(ctx)
	return beatEvery(every, sent, func(<-chan struct{}) (time.Time, bool) {
		start := time.Now()
		switch lost, retry := c.beat(bctx, cl, lease, every); {
		case lost:
			cancel(ErrLeaseLost)
			c.cfg.Logger.LogAttrs(bctx, slog.LevelWarn, "idem: lease lost while the work runs; its context is cancelled",
				slog.String("source", cl.Source), slog.String("key", cl.Key))
			return time.Time{}, true
		case retry:
			// Try again soon: the lease still has about
			// lease*(1-fraction) left from the last extension.
			return time.Now().Add(max(every/4, 50*time.Millisecond)), false
		}
		return start.Add(every), false
	})
}

// beat extends cl's lease by lease once, within every. lost: the key is
// no longer cl's (another worker took it over, or it is gone); retry: the
// extension failed otherwise (logged), and is worth trying again soon.
func (c *Client) beat(ctx context.Context, cl *Claim, lease, every time.Duration) (lost, retry bool) {
	ectx, ecancel := context.WithTimeout(ctx, every)
	_, err := c.Extend(ectx, cl.Source, cl.Key, cl.Token, lease)
	ecancel()
	switch {
	case err == nil:
		return false, false
	case errors.Is(err, ErrStaleToken), errors.Is(err, ErrNotFound):
		return true, false
	}
	c.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idem: lease heartbeat failed; will retry",
		slog.String("source", cl.Source), slog.String("key", cl.Key), slog.Any("error", err))
	return false, true
}

// beatEvery calls beat in a goroutine of its own, first every after sent,
// then at the time each call returns, until beat says stop or the returned
// function is called (which waits for the goroutine to end). beat is given
// the channel that function closes, to stop early within a long beat.
func beatEvery(every time.Duration, sent time.Time, beat func(done <-chan struct{}) (next time.Time, stop bool)) func() {
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTimer(time.Until(sent.Add(every)))
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			next, stop := beat(done)
			if stop {
				return
			}
			t.Reset(time.Until(next))
		}
	}()
	return func() { close(done); <-stopped }
}

// KeepLease keeps the lease of an acquired claim while work runs outside
// Do (a queue worker that took the key over with Extend, say): it extends
// the lease every lease*HeartbeatFraction, timed by this process's clock
// from sent (when the request that granted cl.LeaseRemaining was sent),
// and cancels the returned context with ErrLeaseLost (context.Cause) if
// the lease is lost. The returned function stops it and waits; call it
// before recording the outcome (it may be called again). On a client bound to a transaction, or
// with the heartbeat turned off, it only carries ctx's cancellation.
func (c *Client) KeepLease(ctx context.Context, cl *Claim, sent time.Time) (context.Context, func()) {
	kctx, cancel := context.WithCancelCause(ctx)
	stop := c.heartbeat(kctx, cancel, cl, sent)
	var once sync.Once
	return kctx, func() { once.Do(func() { stop(); cancel(nil) }) }
}
