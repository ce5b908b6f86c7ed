package idemhttp

// Answer is how the middleware answered a request, as told to an Observer.
type Answer string

const (
	// AnswerRan: the handler ran and its answer was sent (stored or not).
	AnswerRan Answer = "ran"
	// AnswerAccepted: asynchronous mode (Config.Async): the delivery was
	// accepted for later processing (202).
	AnswerAccepted Answer = "accepted"
	// AnswerReplayed: a duplicate, answered with the stored answer (in
	// asynchronous mode: a duplicate of an accepted delivery, 202).
	AnswerReplayed Answer = "replayed"
	// AnswerInProgress: a duplicate while the first is still running (409).
	AnswerInProgress Answer = "in_progress"
	// AnswerMismatch: the key was used with a different request (422).
	AnswerMismatch Answer = "mismatch"
	// AnswerFailed: the key's work failed permanently before (422).
	AnswerFailed Answer = "failed"
	// AnswerRefused: the signature was missing or wrong, or Config.Scope
	// named no principal (401); nothing claimed.
	AnswerRefused Answer = "refused"
	// AnswerBadRequest: no usable key or body (400, 413); nothing claimed.
	AnswerBadRequest Answer = "bad_request"
	// AnswerPassedThrough: no key, and PassThroughMissingKey ran the
	// handler without idempotency.
	AnswerPassedThrough Answer = "passed_through"
	// AnswerPanicked: the handler panicked; the key was released (500).
	AnswerPanicked Answer = "panicked"
	// AnswerLeaseLost: the handler's lease lapsed while it ran and another
	// worker took the key over; the handler's own answer is sent if it
	// wrote one, else 409 with Retry-After (the retry gets the other run's
	// answer). Nothing of this run is stored.
	AnswerLeaseLost Answer = "lease_lost"
	// AnswerTimedOut: the handler returned on HandlerTimeout's cancelled
	// context without answering; the key was released (503 with
	// Retry-After).
	AnswerTimedOut Answer = "timed_out"
	// AnswerUnavailable: the idempotency store failed before the handler
	// ran (503); the sender retries.
	AnswerUnavailable Answer = "unavailable"
)

// Observer is told how every request was answered (package idemprom
// counts them). It is called synchronously after the answer was written:
// it must be cheap, safe for concurrent use, and must not block.
type Observer interface {
	ObserveAnswer(source string, a Answer)
}
