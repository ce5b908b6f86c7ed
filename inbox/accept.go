package inbox

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/idemkit/idem"
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

// AcceptTx claims the delivery's key in tx, holding it for the queue
// (Config.QueueLease), and, when the key is new, inserts its River job in
// the same transaction: both commit, or neither. A key seen before is a
// duplicate (Acceptance.Duplicate) and inserts nothing; a key seen with
// another fingerprint is idem.ErrMismatch. Answer the sender 2xx only
// after tx commits.
func (in *Inbox) AcceptTx(ctx context.Context, tx pgx.Tx, d *Delivery) (Acceptance, error) {
	cl, err := in.idem.WithTx(tx).Claim(ctx, d.Source, d.Key, in.claimOptions(d.Fingerprint, d.EventType)...)
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
	id, err := in.insertJob(ctx, tx, Job{
		Source: d.Source, Key: d.Key, EventType: d.EventType, Payload: d.Payload, Header: d.Header,
		Token: cl.Token, FirstSeen: cl.FirstSeen, ExpiresAt: cl.ExpiresAt, AcceptedAt: accepted.UTC(),
	})
	if err != nil {
		return Acceptance{}, err
	}
	return Acceptance{Outcome: cl.Outcome, JobID: id}, nil
}

// claimOptions are the options of every claim the inbox makes, accepting
// or replaying: the key is held for the queue.
func (in *Inbox) claimOptions(fingerprint, eventType string) []idem.ClaimOption {
	opts := []idem.ClaimOption{idem.WithLease(in.cfg.QueueLease)}
	if fingerprint != "" {
		opts = append(opts, idem.WithFingerprint(fingerprint))
	}
	if eventType != "" {
		opts = append(opts, idem.WithEventType(eventType))
	}
	if in.cfg.TTL > 0 {
		opts = append(opts, idem.WithTTL(in.cfg.TTL))
	}
	return opts
}

// insertJob inserts an inbox job in tx.
func (in *Inbox) insertJob(ctx context.Context, tx pgx.Tx, j Job) (int64, error) {
	meta, _ := json.Marshal(map[string]string{"idem_source": j.Source, "idem_key": j.Key})
	res, err := in.insert.InsertTx(ctx, tx, j, &river.InsertOpts{
		Queue: in.cfg.Queue, MaxAttempts: in.maxAttempts(j.Source), Metadata: meta,
	})
	if err != nil {
		return 0, fmt.Errorf("inbox: enqueue %q/%q: %w", j.Source, j.Key, err)
	}
	return res.Job.ID, nil
}
