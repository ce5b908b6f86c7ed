package idemhttp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"runtime/debug"
	"strconv"
	"strings"

	"github.com/idemkit/idem"
)

// Multi-event deliveries. SendGrid and HubSpot post a JSON array of events
// in one signed delivery (Adyen an object holding notificationItems), and
// retry the whole array when the answer is not 2xx: a retry can hold
// events that ran already next to ones that did not. Their presets claim
// every event under its own key (the id the sender keeps across retries,
// inside the signed body), run the handler once with a body holding only
// the events this delivery acquired (a JSON array, in the delivery's
// order), and complete those keys when its answer is stored (2xx), or
// release them otherwise, as the single-event path releases its one key
// (release): a Momentary answer (401, 403, 408, 409, 425, 429, 503) is
// never counted toward max_attempts, any other is. An event already
// completed is left out; one still running under a concurrent copy is
// left out too, and the delivery is then answered 409 with Retry-After
// (after the handler ran for the rest), so the sender retries and learns
// the outcome of the other copy. An event that failed for good (past
// max_attempts) makes the delivery 422, as the single-event path answers
// such a key: no event is ever answered 2xx without its handler having
// run successfully. A delivery whose events all ran before is answered 200
// with Idempotency-Replayed: true, without running anything.
//
// The events are claimed, run and recorded by idem.Client.DoBatch (in
// claimRun): one batch claim per delivery of up to idem.MaxBatch events,
// the leases extended while the handler runs.

// batchSpec describes a multi-event delivery's body.
type batchSpec struct {
	// event returns one event's key and type ("" key: the event has none,
	// and the delivery is refused).
	event func(raw json.RawMessage) (key, eventType string)
	// split returns the delivery's events and a function that builds the
	// body the handler gets from some of them. Default: a JSON array.
	split func(body []byte) ([]json.RawMessage, func([]json.RawMessage) []byte, error)
	// ack answers a delivery whose events all ran before. Default: 200
	// {"duplicate":true}.
	ack func(w http.ResponseWriter)
}

// splitArray is the default batchSpec.split: the body is a JSON array of
// events, and so is the handler's.
func splitArray(body []byte) ([]json.RawMessage, func([]json.RawMessage) []byte, error) {
	var raws []json.RawMessage
	if err := json.Unmarshal(body, &raws); err != nil {
		return nil, nil, fmt.Errorf("not a JSON array of events: %w", err)
	}
	return raws, func(fresh []json.RawMessage) []byte { return joinRaw("[", fresh, "]", "", "") }, nil
}

// joinRaw writes open, then each event between before and after, comma
// separated, then close: the events' bytes exactly as delivered (no
// re-encoding, which would change escapes such as \u0026).
func joinRaw(open string, events []json.RawMessage, close, before, after string) []byte {
	var b bytes.Buffer
	b.WriteString(open)
	for i, e := range events {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(before)
		b.Write(e)
		b.WriteString(after)
	}
	b.WriteString(close)
	return b.Bytes()
}

// batchEvent is one event of a delivery.
type batchEvent struct {
	key, eventType string
	raw            json.RawMessage
}

// checkEvent refuses an event id (or type) idem cannot take for a key
// (or an event type): what the claim would refuse (an id over 512 bytes
// or blank, a type over 256 bytes, a NUL byte or invalid UTF-8 in
// either), checked before anything is claimed, so that the delivery is
// answered 400, as the single-event path answers a key the claim refuses,
// instead of 503 and retries that can never succeed.
func checkEvent(key, eventType string) error {
	switch {
	case len(key) > maxKey:
		return fmt.Errorf("its id is %d bytes, over idem's %d", len(key), maxKey)
	case strings.Trim(key, " \t\r\n") == "":
		return errors.New("its id is blank")
	case idem.CheckText("id", key) != nil:
		return errors.New("its id holds a NUL byte or is not UTF-8 text")
	case len(eventType) > maxEventType:
		return fmt.Errorf("its type is %d bytes, over idem's %d", len(eventType), maxEventType)
	case idem.CheckText("type", eventType) != nil:
		return errors.New("its type holds a NUL byte or is not UTF-8 text")
	}
	return nil
}

// maxEventType is idem's limit on an event type, in bytes.
const maxEventType = 256

// batchTally is what the claims of a delivery's events found.
type batchTally struct {
	busy     int   // running under another copy of the delivery
	refused  int   // failed for good (past max_attempts), or otherwise refused
	ran      bool  // the handler ran
	claimErr error // a claim failed: the handler did not run
}

func (m *middleware) serveBatch(w http.ResponseWriter, r *http.Request, body []byte) Answer {
	split := m.cfg.batch.split
	if split == nil {
		split = splitArray
	}
	raws, rebuild, err := split(body)
	if err != nil {
		problem(w, http.StatusBadRequest, "Not a batch of events",
			fmt.Sprintf("The %s delivery's body: %v", m.cfg.sender, err), nil)
		return AnswerBadRequest
	}
	events := make([]batchEvent, 0, len(raws))
	seen := map[string]bool{}
	for i, raw := range raws {
		key, typ := m.cfg.batch.event(raw)
		if key == "" {
			problem(w, http.StatusBadRequest, "Idempotency key missing",
				fmt.Sprintf("Event %d of %d of the %s delivery has no event id.", i+1, len(raws), m.cfg.sender), nil)
			return AnswerBadRequest
		}
		if err := checkEvent(key, typ); err != nil {
			problem(w, http.StatusBadRequest, "Invalid event",
				fmt.Sprintf("Event %d of %d of the %s delivery cannot be deduplicated: %v (an id is at most %d bytes of UTF-8 text without NUL characters, a type at most %d).",
					i+1, len(raws), m.cfg.sender, err, maxKey, maxEventType), nil)
			return AnswerBadRequest
		}
		if seen[key] { // the same event twice in one delivery: once
			continue
		}
		seen[key] = true
		events = append(events, batchEvent{key: key, eventType: typ, raw: raw})
	}

	// Detached from the request, as in run: once the handler starts, the
	// sender hanging up must not cancel it or keep its outcome from being
	// recorded.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.HandlerTimeout)
	defer cancel()
	var rec *recorder
	var outcome error // the handler's: nil when its answer is stored
	handle := func(ctx context.Context, mine []batchEvent) error {
		fresh := make([]json.RawMessage, len(mine))
		for i, ev := range mine {
			fresh[i] = ev.raw
		}
		newBody := rebuild(fresh)
		rr := r.WithContext(ctx)
		rr.Body, rr.ContentLength = io.NopCloser(bytes.NewReader(newBody)), int64(len(newBody))
		rr.Header = r.Header.Clone()
		rr.Header.Set("Content-Length", strconv.Itoa(len(newBody)))
		rec = newRecorder(w, m.cfg.MaxResponseBody)
		outcome = func() (err error) {
			defer func() {
				if p := recover(); p != nil {
					err = &idem.PanicError{Value: p, Stack: debug.Stack()}
				}
			}()
			m.next.ServeHTTP(rec, rr)
			return m.release(ctx, rec)
		}()
		return outcome
	}
	var t batchTally
	_ = m.claimRun(ctx, chunk(events, idem.MaxBatch), nil, &t, handle) // its error is t.claimErr, or outcome

	switch {
	case t.claimErr != nil && errors.Is(t.claimErr, idem.ErrInvalidInput):
		m.problem(w, r, problemAnswer{status: http.StatusBadRequest, title: "Invalid idempotency key",
			detail: "An event id of this delivery is not usable: at most 512 bytes of UTF-8 text without NUL characters.",
			level:  slog.LevelInfo, msg: "idemhttp: the claim refused an event's key", cause: t.claimErr})
		return AnswerBadRequest
	case t.claimErr != nil:
		m.problem(w, r, problemAnswer{status: http.StatusServiceUnavailable, title: "Idempotency store unavailable",
			detail: "The delivery was not processed; retry later.", headers: map[string]string{"Retry-After": "5"},
			level: slog.LevelError, msg: "idemhttp: idempotency store failed", cause: t.claimErr,
			attrs: []slog.Attr{slog.Int("events", len(events))}})
		return AnswerUnavailable
	case t.ran && outcome != nil:
		// The handler's answer was not stored, and released every event
		// it ran for (counted as an attempt unless Momentary): answered
		// as the single-event path answers such a run.
		return m.answer(w, r, "", rec, &idem.Result{}, outcome)
	case t.busy > 0:
		detail := fmt.Sprintf("%d events of this delivery are being processed by another copy; retry later.", t.busy)
		if t.ran {
			detail = fmt.Sprintf("Some events of this delivery were processed; %d are being processed by another copy; retry later.", t.busy)
		}
		problem(w, http.StatusConflict, "Request in progress", detail, map[string]string{"Retry-After": "1"})
		return AnswerInProgress
	case t.refused > 0:
		// What the single-event path answers for a key past max_attempts,
		// never a 2xx: those events' handler never ran successfully.
		return m.failedPermanently(w, r, "", fmt.Sprintf("%d events of this delivery failed too many times and will not be run again.", t.refused),
			fmt.Errorf("%w: %d events of a %s delivery", idem.ErrFailed, t.refused, m.cfg.sender))
	case t.ran:
		rec.flushTo()
		return AnswerRan
	}
	// Every event ran before.
	m.replayed(w, r, "", http.StatusOK, ReplayStored)
	if m.cfg.batch.ack != nil {
		m.cfg.batch.ack(w)
		return AnswerReplayed
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write([]byte(`{"duplicate":true}` + "\n"))
	return AnswerReplayed
}

// chunk splits events into slices of at most n.
func chunk(events []batchEvent, n int) [][]batchEvent {
	var out [][]batchEvent
	for from := 0; from < len(events); from += n {
		out = append(out, events[from:min(from+n, len(events))])
	}
	return out
}

// claimRun runs a delivery's events through idem.Client.DoBatch, the one
// implementation of a batch's claim, lease heartbeat and recording: the
// first chunk's events (at most idem.MaxBatch, a batch claim's limit) are
// claimed by DoBatch, and inside its work the next chunk's, and so on;
// the innermost work runs handle once over every event acquired (mine, in
// the delivery's order). So each chunk's leases are kept while the
// handler runs (a handler that ignores its context past the lease does
// not run the same events twice), and each event's outcome is recorded
// as Do records one: completed when handle returns nil, released without
// counting the attempt for an idem.Momentary error (401, 403, 408, 409,
// 425, 429, 503: never counted, on every path), released and counted
// otherwise. A claim that fails releases what the chunks before it took,
// without counting, and is t.claimErr.
func (m *middleware) claimRun(ctx context.Context, chunks [][]batchEvent, mine []batchEvent, t *batchTally, handle func(ctx context.Context, mine []batchEvent) error) error {
	if len(chunks) == 0 {
		if len(mine) == 0 {
			return nil // nothing to run
		}
		t.ran = true
		return handle(ctx, mine)
	}
	events := chunks[0]
	items := make([]idem.BatchItem, len(events))
	for i, ev := range events {
		items[i] = idem.BatchItem{Key: ev.key, EventType: ev.eventType}
	}
	var opts []idem.ClaimOption
	if m.cfg.TTL > 0 {
		opts = append(opts, idem.WithTTL(m.cfg.TTL))
	}
	if m.cfg.Lease > 0 {
		opts = append(opts, idem.WithLease(m.cfg.Lease))
	}
	called := false
	var err error
	res, recErr := m.cfg.Client.DoBatch(ctx, m.cfg.Source, items, func(ctx context.Context, acquired []*idem.Claim) ([]idem.WorkResult, error) {
		called = true
		more := append([]batchEvent(nil), mine...)
		k := 0
		for _, cl := range acquired { // in the order of events
			for events[k].key != cl.Key {
				k++
			}
			more = append(more, events[k])
		}
		if err = m.claimRun(ctx, chunks[1:], more, t, handle); err != nil {
			if t.claimErr != nil {
				// A later chunk could not be claimed: nothing ran; not an
				// attempt of these events.
				return nil, idem.Momentary(err)
			}
			return nil, err
		}
		return make([]idem.WorkResult, len(acquired)), nil
	}, opts...)
	if res == nil { // the claim failed: nothing claimed
		t.claimErr = recErr
		return recErr
	}
	if recErr != nil {
		// The events' outcomes could not be recorded: their leases run
		// out and the sender's retry claims them again (they may run
		// twice; nothing is lost).
		m.cfg.Logger.LogAttrs(ctx, slog.LevelError, "idemhttp: could not record the events of a batch",
			slog.String("source", m.cfg.Source), slog.Int("events", len(events)), slog.Bool("handled", t.ran && err == nil), slog.Any("error", recErr))
	}
	for _, br := range res {
		switch br.Claim.Outcome {
		case idem.Acquired, idem.Completed:
		case idem.InProgress:
			t.busy++
		default: // Failed (past max_attempts), or Mismatch
			t.refused++
		}
	}
	if !called {
		return m.claimRun(ctx, chunks[1:], mine, t, handle)
	}
	return err
}
