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
	"github.com/idemkit/idem/db/pgxdb"
)

// Job is the River job of one accepted delivery: its payload, and the
// fencing token of the claim it was accepted under (the token its key is
// held with).
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
	// The delivery's own retention and lease (0: the Inbox's).
	TTLMillis   int64 `json:"ttl_ms,omitempty"`
	LeaseMillis int64 `json:"lease_ms,omitempty"`
	// MaxAttempts is the attempts the Inbox that accepted the event allowed
	// its source (Config.MaxAttempts): a replay or a repair, whichever
	// process runs it (idemctl, the dashboard), enqueues the new job with
	// it. 0 in jobs of earlier versions: their River job's max attempts.
	MaxAttempts int `json:"max_attempts,omitempty"`
	// The request the delivery arrived as (Delivery.Method, Target, Host,
	// Pattern, Principal). Each is absent from the jobs of the versions
	// before it, and its zero value is what those versions did: a job
	// without a method was accepted before the method was kept, and is
	// replayed as POST, as it was then; one without a principal is
	// handed none.
	Method    string `json:"method,omitempty"`
	Target    string `json:"target,omitempty"`
	Host      string `json:"host,omitempty"`
	Pattern   string `json:"pattern,omitempty"`
	Principal string `json:"principal,omitempty"`
	// Trace is the trace context of the request that accepted the event,
	// as the client's tracer wrote it (idem.OpEnqueue's Carrier). It is
	// kept in the job's River metadata (idem_trace), not its arguments:
	// a retry, a restart and a replay hand it to the worker's tracer.
	Trace map[string]string `json:"-"`
	// replayOf is the job a replay's new job replaces (not part of the
	// args: it goes to the metadata, as idem_replay_of).
	replayOf int64
}

// Kind implements river.JobArgs.
func (Job) Kind() string { return Kind }

// Errors a job ends with.
var (
	// ErrKeyGone: the event's key was deleted (by hand, or with its month's
	// partition) before its job ran. The job is a dead letter with this
	// reason; replay it to process the event.
	ErrKeyGone = errors.New("inbox: the event's key is gone")
	// ErrSuperseded: another attempt of the same job took the key from
	// this one (River rescued the job while this attempt still ran); this
	// attempt's work rolled back.
	ErrSuperseded = errors.New("inbox: another attempt of this job took the key")
)

// recordTimeout bounds each recording of a failed attempt, detached from
// the job's context: it ends in a retry, never a hang.
const recordTimeout = idem.DefaultRecordTimeout

// worker runs inbox jobs.
type worker struct {
	river.WorkerDefaults[Job]
	in *Inbox
}

// MomentaryWindow is how long after its acceptance an event's momentary
// failures (idem.Momentary; FromHTTP's 401, 403, 408, 409, 425, 429 and
// 503) are not counted as attempts: past it they count, toward a dead
// letter.
const MomentaryWindow = 24 * time.Hour

// snooze is how long a job waits after a momentary failure: the retry
// policy's delay for the attempt after the ones it made, one more for each
// snooze before (River keeps their count in the job's metadata), so a
// long outage is retried with the policy's growing backoff although no
// attempt is counted.
func (w *worker) snooze(job *river.Job[Job]) time.Duration {
	var m struct {
		Snoozes int `json:"snoozes"`
	}
	_ = json.Unmarshal(job.Metadata, &m)
	row := *job.JobRow
	row.Attempt += m.Snoozes
	return max(time.Until(w.in.cfg.RetryPolicy.NextRetry(&row)), 0)
}

// NextRetry is Config.RetryPolicy's.
func (w *worker) NextRetry(job *river.Job[Job]) time.Time {
	return w.in.cfg.RetryPolicy.NextRetry(job.JobRow)
}

// lease is the lease of each attempt of the job.
func (in *Inbox) lease(j Job) time.Duration {
	if j.LeaseMillis > 0 {
		return time.Duration(j.LeaseMillis) * time.Millisecond
	}
	return in.cfg.RunLease
}

// Work takes the key for this attempt, runs the handler, and completes
// the key, releases its hold and completes the job in one transaction. It
// is reported to the client's tracer as idem.OpProcess, with the trace
// context the job was accepted under.
func (w *worker) Work(ctx context.Context, job *river.Job[Job]) error {
	tr := w.in.idem.Tracer()
	if tr == nil {
		return w.work(ctx, job, new(string))
	}
	a := job.Args
	ctx = tr.TraceStart(ctx, idem.TraceStartData{Op: idem.OpProcess, Source: a.Source, Key: a.Key,
		Carrier: jobTrace(job.Metadata), Queue: job.Queue, JobID: job.ID, Attempt: job.Attempt, AcceptedAt: a.AcceptedAt})
	start := time.Now()
	var outcome string
	err := w.work(ctx, job, &outcome)
	tr.TraceEnd(ctx, idem.TraceEndData{Op: idem.OpProcess, Source: a.Source, Key: a.Key, JobID: job.ID,
		Detail: outcome, Err: err, Duration: time.Since(start)})
	return err
}

// Outcomes of an attempt (idem.OpProcess's TraceEndData.Detail).
const (
	ProcessProcessed    = "processed"     // the handler ran and the event is completed
	ProcessSkipped      = "skipped"       // nothing to do: processed before, or another job holds the event
	ProcessRetried      = "retried"       // the handler failed; River retries the job
	ProcessDeadLettered = "dead_lettered" // failed for good, or out of attempts: a dead letter
)

// jobTrace reads the trace context a job was accepted with from its River
// metadata (nil when it has none).
func jobTrace(metadata []byte) map[string]string {
	var m struct {
		Trace map[string]string `json:"idem_trace"`
	}
	if len(metadata) == 0 || json.Unmarshal(metadata, &m) != nil {
		return nil
	}
	return m.Trace
}

func (w *worker) work(ctx context.Context, job *river.Job[Job], outcome *string) error {
	in, a := w.in, job.Args
	*outcome = ProcessRetried
	log := in.cfg.Logger.With(slog.String("source", a.Source), slog.String("key", a.Key), slog.Int64("job", job.ID), slog.Int("attempt", job.Attempt))

	if err := in.refuseCitus(ctx, in.cfg.Pool); err != nil {
		return err
	}
	lease := in.lease(a)
	sent := time.Now()
	tk, err := pgxdb.New(in.cfg.Pool).QueueTake(ctx, pgxdb.QueueTakeParams{Source: a.Source, Key: a.Key,
		JobToken: a.Token, JobID: job.ID, LeaseMs: lease.Milliseconds()})
	if err != nil {
		return fmt.Errorf("inbox: take the key: %w", err)
	}
	switch tk.Outcome {
	case "taken":
	case "done":
		*outcome = ProcessSkipped
		log.LogAttrs(ctx, slog.LevelInfo, "inbox: the event is already processed; nothing to do")
		return nil
	case "superseded":
		*outcome = ProcessSkipped
		log.LogAttrs(ctx, slog.LevelInfo, "inbox: another job holds the event now (a replay, or a redelivery after a dead letter); nothing to do")
		return nil
	case "gone":
		*outcome = ProcessDeadLettered
		log.LogAttrs(ctx, slog.LevelError, "inbox: dead-lettered: the event's key is gone", slog.String("reason", tk.Error))
		return river.JobCancel(fmt.Errorf("%w: %s", ErrKeyGone, tk.Error))
	case "failed":
		*outcome = ProcessDeadLettered
		log.LogAttrs(ctx, slog.LevelError, "inbox: dead-lettered: the event's key failed for good", slog.String("reason", tk.Error))
		return river.JobCancel(fmt.Errorf("inbox: the event's key failed for good: %s", tk.Error))
	default:
		return fmt.Errorf("inbox: take the key: unexpected outcome %q", tk.Outcome)
	}
	cl := &idem.Claim{Outcome: idem.Acquired, Source: a.Source, Key: a.Key, Token: tk.Token, Attempt: int(tk.Attempt),
		Error: tk.Error, FirstSeen: a.FirstSeen, ExpiresAt: a.ExpiresAt, LeaseRemaining: lease}
	if tk.LeaseExpiresAt.Valid {
		cl.LeaseExpiresAt = tk.LeaseExpiresAt.Time
	}
	hctx, release := in.idem.KeepLease(ctx, cl, sent)
	defer release()

	herr := w.run(idem.WithEvent(hctx, cl), job, cl)
	lost := errors.Is(context.Cause(hctx), idem.ErrLeaseLost) || errors.Is(herr, idem.ErrLeaseLost)
	release()
	if herr == nil {
		*outcome = ProcessProcessed
		return nil
	}
	if lost {
		*outcome = ProcessSkipped
		// Another attempt of this job took the key (River rescued the job
		// while this one ran): this attempt's writes rolled back, and that
		// attempt finishes the event.
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: another attempt of this job took the key; this attempt's work rolled back", slog.Any("error", herr))
		return nil
	}

	if idem.IsMomentary(herr) && !idem.IsPermanent(herr) && time.Since(job.CreatedAt) < MomentaryWindow {
		// About the moment (the handler answered 429 or 503, a dependency
		// was briefly down): as on every path, not an attempt. The key is
		// released without counting (idem.FailMomentary, still held for
		// this job) and the job snoozed, which River does not count
		// either, on the retry policy's schedule for one attempt more per
		// snooze. Past MomentaryWindow such failures count, so that an
		// event whose handler never stops answering 503 still ends as a
		// dead letter an operator sees.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
		err := in.idem.FailMomentary(rctx, a.Source, a.Key, cl.Token, storableError{herr}.Error())
		if err == nil {
			*outcome = ProcessRetried
			log.LogAttrs(ctx, slog.LevelInfo, "inbox: momentary failure, not counted; snoozed", slog.Any("error", herr))
			return river.JobSnooze(w.snooze(job))
		}
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: could not release the key after a momentary failure; counted as an attempt", slog.Any("error", err))
	}

	// Failed. Record it on the key (detached, bounded): past the last
	// attempt, or for a permanent error, the key's hold becomes a dead
	// letter (a replay or the sender's redelivery can take it again) and
	// River discards or cancels the job. Otherwise the key stays held
	// through River's backoff.
	permanent := idem.IsPermanent(herr)
	dead := permanent || job.Attempt >= job.MaxAttempts
	// The error as the key, the dead letter and River's attempt record
	// store it (an error page cut mid-character, a NUL: PostgreSQL's text
	// and jsonb refuse them, and the failure would go unrecorded).
	herr = storableError{herr}
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
	defer cancel()
	out, err := pgxdb.New(in.cfg.Pool).QueueFail(rctx, pgxdb.QueueFailParams{Source: a.Source, Key: a.Key,
		JobToken: a.Token, Token: cl.Token, Error: herr.Error(), Dead: dead})
	switch {
	case err != nil:
		// The job is retried (or, past its attempts, discarded, and Repair
		// dead-letters the event with its payload and River's last error):
		// the key is still held for it.
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: could not record the failure on the key", slog.Any("error", err), slog.Any("failure", herr))
		if dead {
			return fmt.Errorf("%w (and recording it failed: %w)", herr, err)
		}
	case out == "dead":
		*outcome = ProcessDeadLettered
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: dead-lettered", slog.Any("error", herr))
		in.keepPayload(rctx, log, a, job.EncodedArgs)
	case out != "failed":
		*outcome = ProcessSkipped
		log.LogAttrs(ctx, slog.LevelWarn, "inbox: another attempt of this job took the key", slog.String("outcome", out))
		return nil
	}
	if permanent {
		return river.JobCancel(herr)
	}
	return herr
}

// run calls the handler in a transaction and, when it succeeds, completes
// the key, releases its hold and completes the job in that transaction.
func (w *worker) run(ctx context.Context, job *river.Job[Job], cl *idem.Claim) error {
	in, a := w.in, job.Args
	h, err := in.handlerFor(a.Source)
	if err != nil {
		return err // retried, then a dead letter that names the source
	}
	tx, err := in.cfg.Pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), recordTimeout)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	d := &Delivery{Source: a.Source, Key: a.Key, EventType: a.EventType, Payload: a.Payload, Header: a.Header,
		AcceptedAt: a.AcceptedAt, Attempt: job.Attempt, Method: a.Method, Target: a.Target, Host: a.Host, Pattern: a.Pattern,
		Principal: a.Principal}
	result, err := call(ctx, h, tx, d)
	if err != nil {
		return err
	}
	p := pgxdb.QueueCompleteParams{Source: a.Source, Key: a.Key, JobToken: a.Token, Token: cl.Token}
	if result != nil {
		// What the server would refuse is known before the statement (the
		// core's one check), so that the refusal cannot roll back the
		// handler's transaction: the key completes without the result.
		raw, err := json.Marshal(result)
		if err == nil {
			err = idem.CheckResult(raw)
		}
		if err != nil {
			reason := idem.StorableText("the handler's result cannot be stored: " + err.Error())
			p.Reason = &reason
		} else {
			s := string(raw)
			p.Result = &s
		}
	}
	out, err := pgxdb.New(tx).QueueComplete(ctx, p)
	if err != nil {
		return fmt.Errorf("inbox: complete the key: %w", err)
	}
	switch out {
	case "completed":
	case "completed_unstored":
		attrs := []slog.Attr{slog.String("source", a.Source), slog.String("key", a.Key), slog.Int64("job", job.ID)}
		if p.Reason != nil {
			attrs = append(attrs, slog.String("reason", *p.Reason))
		} else {
			attrs = append(attrs, slog.String("reason", "over idem's 1 MiB result limit"), slog.Int("bytes", len(*p.Result)))
		}
		in.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "inbox: processed; the result was not stored (the key's error says why)", attrs...)
	case "stale_token", "not_held":
		return fmt.Errorf("%w: %w (%s)", idem.ErrLeaseLost, ErrSuperseded, out)
	default:
		return fmt.Errorf("inbox: complete the key: %s", out)
	}
	if _, err := river.JobCompleteTx[*riverpgxv5.Driver](ctx, tx, job); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// storableError is a handler's error whose text is made storable
// (idem.StorableText); it unwraps to the error.
type storableError struct{ err error }

func (e storableError) Error() string { return idem.StorableText(e.err.Error()) }
func (e storableError) Unwrap() error { return e.err }

// call runs the handler, turning a panic into an error.
func call(ctx context.Context, h Handler, tx pgx.Tx, d *Delivery) (v any, err error) {
	defer func() {
		if p := recover(); p != nil {
			v, err = nil, &idem.PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return h(ctx, tx, d)
}
