package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/idemkit/idem"
)

// Job is the River job of one accepted delivery: its payload, and the
// fencing token of the claim it was accepted under.
type Job struct {
	Source     string      `json:"source"`
	Key        string      `json:"key"`
	EventType  string      `json:"event_type,omitempty"`
	Payload    []byte      `json:"payload"`
	Header     http.Header `json:"header,omitempty"`
	Token      int64       `json:"token"`
	FirstSeen  time.Time   `json:"first_seen"`
	ExpiresAt  time.Time   `json:"expires_at"`
	AcceptedAt time.Time   `json:"accepted_at"`
}

// Kind implements river.JobArgs.
func (Job) Kind() string { return Kind }

// worker runs inbox jobs.
type worker struct {
	river.WorkerDefaults[Job]
	in *Inbox
}

// NextRetry is Config.RetryPolicy's: the worker needs to know it, to keep
// the key through the backoff.
func (w *worker) NextRetry(job *river.Job[Job]) time.Time {
	return w.in.cfg.RetryPolicy.NextRetry(job.JobRow)
}

// Work runs the handler under the job's claim and completes the key and
// the job in one transaction.
func (w *worker) Work(ctx context.Context, job *river.Job[Job]) error {
	in, a := w.in, job.Args
	log := in.cfg.Logger.With(slog.String("source", a.Source), slog.String("key", a.Key), slog.Int64("job", job.ID), slog.Int("attempt", job.Attempt))

	// Take the key from the queue to this run. A stale token means a
	// redelivery took the key over after the queue lease (its own job will
	// process it), or the key is done: either way, nothing to do here.
	sent := time.Now()
	until, err := in.idem.Extend(ctx, a.Source, a.Key, a.Token, in.cfg.RunLease)
	if errors.Is(err, idem.ErrStaleToken) || errors.Is(err, idem.ErrNotFound) {
		log.LogAttrs(ctx, slog.LevelInfo, "inbox: the key is no longer this job's (taken over by a later acceptance, or done); nothing to do")
		return nil
	}
	if err != nil {
		return err
	}
	cl := &idem.Claim{Outcome: idem.Acquired, Source: a.Source, Key: a.Key, Token: a.Token, Attempt: job.Attempt,
		LeaseExpiresAt: until, FirstSeen: a.FirstSeen, ExpiresAt: a.ExpiresAt, LeaseRemaining: in.cfg.RunLease}
	hctx, release := in.idem.KeepLease(ctx, cl, sent)
	defer release()

	herr := w.run(idem.WithEvent(hctx, cl), job)
	lost := errors.Is(context.Cause(hctx), idem.ErrLeaseLost) || errors.Is(herr, idem.ErrLeaseLost)
	release()
	if herr == nil && lost {
		herr = idem.ErrLeaseLost
	}
	if herr == nil {
		return nil
	}
	if lost {
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: lease lost while the handler ran; another job owns the key now", slog.Any("error", herr))
		return nil
	}

	// Failed. Past the last attempt (or told it is permanent), release the
	// key with the error, for a replay to claim it again, and let River
	// dead-letter the job. Otherwise keep the key through River's backoff.
	rctx := context.WithoutCancel(ctx)
	permanent := idem.IsPermanent(herr)
	if permanent || job.Attempt >= job.MaxAttempts {
		if err := in.idem.Fail(rctx, a.Source, a.Key, a.Token, herr.Error(), true); err != nil {
			log.LogAttrs(ctx, slog.LevelWarn, "inbox: could not record the dead letter's error on its key", slog.Any("error", err))
		}
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: dead-lettered", slog.Any("error", herr))
		if permanent {
			return river.JobCancel(herr)
		}
		return herr
	}
	keep := min(time.Until(w.NextRetry(job))+in.cfg.QueueLease, 7*24*time.Hour)
	if _, err := in.idem.Extend(rctx, a.Source, a.Key, a.Token, keep); err != nil {
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: could not keep the key through the backoff", slog.Any("error", err))
	}
	return herr
}

// run calls the handler in a transaction and, when it succeeds, completes
// the key and the job in that transaction.
func (w *worker) run(ctx context.Context, job *river.Job[Job]) error {
	in, a := w.in, job.Args
	tx, err := in.cfg.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	d := &Delivery{Source: a.Source, Key: a.Key, EventType: a.EventType, Payload: a.Payload, Header: a.Header,
		AcceptedAt: a.AcceptedAt, Attempt: job.Attempt}
	result, err := call(ctx, in.cfg.Handler, tx, d)
	if err != nil {
		return err
	}
	var raw json.RawMessage
	if result != nil {
		if raw, err = json.Marshal(result); err != nil {
			return idem.Permanent(fmt.Errorf("inbox: the handler's result is not JSON: %w", err))
		}
	}
	if err := in.idem.WithTx(tx).Complete(ctx, a.Source, a.Key, a.Token, raw); err != nil {
		if errors.Is(err, idem.ErrStaleToken) {
			return fmt.Errorf("%w: %w", idem.ErrLeaseLost, err)
		}
		return err
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// call runs the handler, turning a panic into an error.
func call(ctx context.Context, h Handler, tx pgx.Tx, d *Delivery) (v any, err error) {
	defer func() {
		if p := recover(); p != nil {
			v, err = nil, &idem.PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return h(ctx, tx, d)
}

// AddWorker registers the inbox worker on workers, for an application
// that runs its own River client: add the inbox queue (Queue) to that
// client's Queues as well.
func (in *Inbox) AddWorker(workers *river.Workers) error {
	if in.cfg.Handler == nil {
		return ErrNoHandler
	}
	return river.AddWorkerSafely(workers, &worker{in: in})
}

// NewWorkerClient returns a River client that works the inbox queue with
// up to maxWorkers handlers at once (0: DefaultMaxWorkers); call its Start
// and, on shutdown, Stop. base, when not nil, supplies the rest of River's
// configuration (its Workers and Queues are replaced).
func (in *Inbox) NewWorkerClient(maxWorkers int, base *river.Config) (*river.Client[pgx.Tx], error) {
	if in.cfg.Handler == nil {
		return nil, ErrNoHandler
	}
	if maxWorkers == 0 {
		maxWorkers = DefaultMaxWorkers
	}
	cfg := river.Config{Logger: quiet(in.cfg.Logger)}
	if base != nil {
		cfg = *base
	}
	cfg.Schema = in.cfg.Schema
	cfg.Workers = river.NewWorkers()
	if err := in.AddWorker(cfg.Workers); err != nil {
		return nil, err
	}
	cfg.Queues = map[string]river.QueueConfig{in.cfg.Queue: {MaxWorkers: maxWorkers}}
	return river.NewClient(riverpgxv5.New(in.cfg.Pool), &cfg)
}
