package idem

import "time"

// Observer is told what every claim of a Client decided, for metrics:
// package idemprom implements it with Prometheus counters per source and
// outcome, registered on the application's own registry. ObserveClaim is
// called synchronously on the claim's path (also for the claims Do and
// idemhttp make): it must be cheap, safe for concurrent use, and must not
// block. Set it in Config.Observer; clients derived by WithTx and
// WithSQLTx share it.
type Observer interface {
	ObserveClaim(ClaimObservation)
}

// ClaimObservation is one claim as an Observer sees it.
type ClaimObservation struct {
	Source string
	// Outcome is what the database decided; empty when the claim failed
	// (Err is set). Every outcome but Acquired answers a duplicate.
	Outcome Outcome
	// Err is the claim's error (an *Error: ErrInvalidInput, a database
	// error, ...), nil when the claim answered.
	Err error
	// Duration is the claim's wall time in this process; for an item of a
	// batch (ClaimBatch, DoBatch), the wall time of the whole batch call.
	Duration time.Duration
	// Batch is the number of items of the batch the claim was part of;
	// 0 for a claim of one key (Claim, Do).
	Batch int
}

// Duplicate reports whether the claim answered a delivery seen before:
// any outcome but Acquired.
func (o ClaimObservation) Duplicate() bool { return o.Err == nil && o.Outcome != Acquired }
