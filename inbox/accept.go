package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/db/pgxdb"
)

// Acceptance is what Accept decided.
type Acceptance struct {
	// Duplicate: the key was accepted before (queued, being processed,
	// processed, or dead-lettered); nothing was inserted. Outcome is the
	// claim's answer.
	Duplicate bool
	Outcome   idem.Outcome
	// JobID is the River job inserted for a new delivery.
	JobID int64
}

// Accept claims the delivery's key and inserts its job, in one transaction
// of its own; see AcceptTx.
func (in *Inbox) Accept(ctx context.Context, d *Delivery) (Acceptance, error) {
	var a Acceptance
	err := pgx.BeginFunc(ctx, in.cfg.Pool, func(tx pgx.Tx) error {
		var err error
		a, err = in.AcceptTx(ctx, tx, d)
		return err
	})
	return a, err
}

// AcceptTx claims the delivery's key in tx and, when the key is new,
// inserts its River job and holds the key for it, in the same transaction:
// all commit, or none. A key seen before is a duplicate
// (Acceptance.Duplicate) and inserts nothing; a key seen with another
// fingerprint is idem.ErrMismatch. Answer the sender 2xx only after tx
// commits. Its statements (idem's and River's) need no prepared statement
// kept on a server session, so that it works through a transaction pooler
// with pgx's default configuration (see pooler.go).
func (in *Inbox) AcceptTx(ctx context.Context, tx pgx.Tx, d *Delivery) (Acceptance, error) {
	tx = pooled(tx) // through a transaction pooler too (pooler.go)
	if err := in.refuseCitus(ctx, tx); err != nil {
		return Acceptance{}, err
	}
	if err := checkStorable(d); err != nil {
		return Acceptance{}, fmt.Errorf("inbox: accept %q/%q: %w", idem.Quote(d.Source), idem.Quote(d.Key), err)
	}
	if d.GuardSource != "" {
		// The replay guard: the signed body, claimed for this key.
		g, err := in.idem.WithTx(tx).Claim(ctx, d.GuardSource, d.GuardKey, in.claimOptions(d.Key, "", d.TTL)...)
		switch {
		case err != nil:
			return Acceptance{}, err
		case g.Outcome == idem.Mismatch:
			// The same signed body under another delivery id: a copy.
			return Acceptance{Duplicate: true, Outcome: idem.Completed}, nil
		case g.Outcome == idem.Acquired:
			if err := in.idem.WithTx(tx).Complete(ctx, d.GuardSource, d.GuardKey, g.Token, nil); err != nil {
				return Acceptance{}, err
			}
		}
	}
	cl, err := in.idem.WithTx(tx).Claim(ctx, d.Source, d.Key, in.claimOptions(d.Fingerprint, d.EventType, d.TTL)...)
	if err != nil {
		return Acceptance{}, err
	}
	switch cl.Outcome {
	case idem.Acquired:
	case idem.Mismatch:
		return Acceptance{Outcome: cl.Outcome}, fmt.Errorf("inbox: accept %q/%q: %w", d.Source, d.Key, idem.ErrMismatch)
	default:
		return Acceptance{Duplicate: true, Outcome: cl.Outcome}, nil
	}
	accepted := d.AcceptedAt
	if accepted.IsZero() {
		accepted = time.Now()
	}
	id, err := in.enqueue(ctx, tx, cl, Job{
		Source: d.Source, Key: d.Key, EventType: d.EventType, Payload: d.Payload, Header: d.Header,
		AcceptedAt: accepted.UTC(), TTLMillis: d.TTL.Milliseconds(), LeaseMillis: d.Lease.Milliseconds(),
		MaxAttempts: in.maxAttempts(d.Source),
		Method:      d.Method, Target: d.Target, Host: d.Host, Pattern: d.Pattern, Principal: d.Principal,
	})
	if err != nil {
		return Acceptance{}, err
	}
	return Acceptance{Outcome: cl.Outcome, JobID: id}, nil
}

// checkStorable refuses, with idem.ErrInvalidInput, a delivery whose texts
// its job could not store (River keeps a job's arguments as jsonb, which
// holds no NUL): its method, request target, host, route pattern and
// principal (also refused
// when not UTF-8; idemhttp's are always storable) and kept headers. A
// header value that is not UTF-8 (a Latin-1 User-Agent, which HTTP allows)
// is kept with U+FFFD in place of each invalid byte, as encoding/json
// writes it, rather than refusing the delivery for it.
func checkStorable(d *Delivery) error {
	for what, s := range map[string]string{"method": d.Method, "request target": d.Target, "host": d.Host,
		"route pattern": d.Pattern, "principal": d.Principal} {
		if err := idem.CheckText(what, s); err != nil {
			return err
		}
	}
	for name, values := range d.Header {
		for _, v := range append([]string{name}, values...) {
			if strings.IndexByte(v, 0) >= 0 {
				return idem.CheckText("header "+strings.ToValidUTF8(name, "\uFFFD"), v)
			}
		}
	}
	return nil
}

// claimOptions are the options of every claim the inbox makes, accepting
// or replaying. The key is held for its job (idem.queue_hold), so its
// lease while it waits does not matter: the claim takes the source's.
func (in *Inbox) claimOptions(fingerprint, eventType string, ttl time.Duration) []idem.ClaimOption {
	var opts []idem.ClaimOption
	if fingerprint != "" {
		opts = append(opts, idem.WithFingerprint(fingerprint))
	}
	if eventType != "" {
		opts = append(opts, idem.WithEventType(eventType))
	}
	if ttl <= 0 {
		ttl = in.cfg.TTL
	}
	if ttl > 0 {
		opts = append(opts, idem.WithTTL(ttl))
	}
	return opts
}

// enqueue inserts the job of a key acquired in tx (cl) and holds the key
// for it; a dead letter of the same key that the hold replaces (the event
// accepted again, or replayed) is removed, in tx. Accept and Replay both
// come here.
//
// The insert is reported to the client's tracer (idem.OpEnqueue): the
// trace context it writes goes with the job (Job.Trace), unless the job
// already carries the one of the request that first accepted its event
// (a replay).
func (in *Inbox) enqueue(ctx context.Context, tx pgx.Tx, cl *idem.Claim, j Job) (id int64, err error) {
	tx = pooled(tx)
	j.Token, j.FirstSeen, j.ExpiresAt = cl.Token, cl.FirstSeen, cl.ExpiresAt
	if tr := in.idem.Tracer(); tr != nil {
		carrier := map[string]string{}
		ctx = tr.TraceStart(ctx, idem.TraceStartData{Op: idem.OpEnqueue, Source: j.Source, Key: j.Key, Carrier: carrier, Queue: in.cfg.Queue})
		start := time.Now()
		defer func() {
			tr.TraceEnd(ctx, idem.TraceEndData{Op: idem.OpEnqueue, Source: j.Source, Key: j.Key, JobID: id, Err: err, Duration: time.Since(start)})
		}()
		if j.Trace == nil && len(carrier) > 0 {
			j.Trace = carrier
		}
	}
	res, err := in.insert.InsertTx(ctx, tx, j, in.insertOpts(j))
	if err != nil {
		return 0, fmt.Errorf("inbox: enqueue %q/%q: %w", j.Source, j.Key, err)
	}
	dead, err := pgxdb.New(tx).QueueHold(ctx, pgxdb.QueueHoldParams{Source: j.Source, Key: j.Key, Token: j.Token, JobID: res.Job.ID})
	if err != nil {
		return 0, fmt.Errorf("inbox: hold %q/%q: %w", j.Source, j.Key, err)
	}
	if dead != 0 {
		// A job River has not finalized yet (the dead letter was recorded
		// a moment ago) is left: it is discarded as it ends, and no longer
		// a dead letter, since its hold passed to the new job.
		if _, err := in.insert.JobDeleteTx(ctx, tx, dead); err != nil && !errorsIsNotFound(err) && !errors.Is(err, rivertype.ErrJobRunning) {
			return 0, fmt.Errorf("inbox: remove the dead letter (job %d) of %q/%q: %w", dead, j.Source, j.Key, err)
		}
	}
	return res.Job.ID, nil
}

// insertOpts are the options of an inbox job's insert: the attempts the
// job's event was accepted with (Job.MaxAttempts), else this Inbox's.
func (in *Inbox) insertOpts(j Job) *river.InsertOpts {
	// The event type and acceptance time are in the metadata too, so that
	// listing dead letters never reads the args, which hold the payload.
	// The trace context (Job.Trace) goes there, not in the args, whose
	// headers are the delivery's own.
	m := map[string]any{"idem_source": j.Source, "idem_key": j.Key,
		"idem_event_type": j.EventType, "idem_accepted_at": j.AcceptedAt.UTC().Format(time.RFC3339Nano)}
	if len(j.Trace) > 0 {
		m["idem_trace"] = j.Trace
	}
	if j.replayOf != 0 {
		// A replay's job: the dashboard marks it (inbox.JobInfo.Replay).
		m["idem_replay_of"] = strconv.FormatInt(j.replayOf, 10)
	}
	meta, _ := json.Marshal(m)
	n := j.MaxAttempts
	if n < 1 {
		n = in.maxAttempts(j.Source)
	}
	return &river.InsertOpts{Queue: in.cfg.Queue, MaxAttempts: n, Metadata: meta}
}

// errorsIsNotFound: River has no such job (removed meanwhile).
func errorsIsNotFound(err error) bool { return errors.Is(err, river.ErrNotFound) }
