package idemhttp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// Multi-event deliveries. SendGrid and HubSpot post a JSON array of events
// in one signed delivery (Adyen an object holding notificationItems), and retry the whole array when the answer is not
// 2xx: a retry can hold events that ran already next to ones that did not.
// Their presets claim every event under its own key (the id the sender
// keeps across retries, inside the signed body), run the handler once with
// a body holding only the events this delivery acquired (a JSON array, in
// the delivery's order), and complete those keys when it answers 2xx, or
// release them otherwise. An event already completed is left out; one
// still running under a concurrent copy is left out too, and the delivery
// is then answered 409 with Retry-After (after the handler ran for the
// rest), so the sender retries and learns the outcome of the other copy.
// A delivery whose events all ran before is answered 200 with
// Idempotency-Replayed: true, without running anything.
//
// The events are claimed on their own keys in one batch claim
// (idem.Client.ClaimBatch, in claimEach): one round trip per delivery.

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

// batchLeaseMargin is added to the handler's timeout for the lease of a
// batch's keys: the handler is bounded by its timeout, so the lease
// outlives it without a heartbeat.
const batchLeaseMargin = 30 * time.Second

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
		if seen[key] { // the same event twice in one delivery: once
			continue
		}
		seen[key] = true
		events = append(events, batchEvent{key: key, eventType: typ, raw: raw})
	}

	lease := max(m.cfg.Lease, m.cfg.HandlerTimeout+batchLeaseMargin)
	mine, busy, err := m.claimEach(r.Context(), events, lease)
	if err != nil {
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: idempotency store failed",
			slog.String("source", m.cfg.Source), slog.Int("events", len(events)), slog.Any("error", err))
		problem(w, http.StatusServiceUnavailable, "Idempotency store unavailable",
			"The delivery was not processed; retry later.", map[string]string{"Retry-After": "5"})
		return AnswerUnavailable
	}
	if len(mine) == 0 {
		if busy > 0 {
			problem(w, http.StatusConflict, "Request in progress",
				fmt.Sprintf("%d events of this delivery are being processed by another copy; retry later.", busy),
				map[string]string{"Retry-After": "1"})
			return AnswerInProgress
		}
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

	fresh := make([]json.RawMessage, len(mine))
	for i, c := range mine {
		fresh[i] = c.raw
	}
	newBody := rebuild(fresh)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.HandlerTimeout)
	defer cancel()
	rr := r.WithContext(ctx)
	rr.Body, rr.ContentLength = io.NopCloser(bytes.NewReader(newBody)), int64(len(newBody))
	rr.Header = r.Header.Clone()
	rr.Header.Set("Content-Length", strconv.Itoa(len(newBody)))
	rec := newRecorder(w, m.cfg.MaxResponseBody)
	panicked := func() (p any) {
		defer func() { p = recover() }()
		m.next.ServeHTTP(rec, rr)
		return nil
	}()

	rctx, rcancel := context.WithTimeout(context.WithoutCancel(r.Context()), idem.DefaultRecordTimeout)
	defer rcancel()
	ok := panicked == nil && m.cfg.Store(rec.status())
	for _, c := range mine {
		var err error
		if ok {
			err = m.cfg.Client.Complete(rctx, m.cfg.Source, c.key, c.token, nil)
		} else {
			err = m.cfg.Client.Fail(rctx, m.cfg.Source, c.key, c.token, fmt.Sprintf("handler answered %d", rec.status()), true)
		}
		if err != nil {
			// The lease runs out and the sender's retry claims the event
			// again: nothing is lost, it may run twice.
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: could not record an event of a batch",
				slog.String("source", m.cfg.Source), slog.String("key", c.key), slog.Bool("handled", ok), slog.Any("error", err))
		}
	}
	switch {
	case panicked != nil:
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: handler panicked; the batch's keys were released",
			slog.String("source", m.cfg.Source), slog.Int("events", len(mine)), slog.Any("panic", panicked))
		problem(w, http.StatusInternalServerError, "Internal error", "The handler failed; retry the request.", nil)
		return AnswerPanicked
	case ok && busy > 0:
		problem(w, http.StatusConflict, "Request in progress",
			fmt.Sprintf("%d events of this delivery were processed; %d are being processed by another copy; retry later.", len(mine), busy),
			map[string]string{"Retry-After": "1"})
		return AnswerInProgress
	}
	rec.flushTo()
	return AnswerRan
}

// claimed is an event of a delivery this delivery acquired.
type claimed struct {
	batchEvent
	token int64
}

// claimEach claims every event's key in batch claims (which take the keys
// in one global order: two copies of one delivery cannot deadlock). It
// returns the events
// acquired, in the delivery's order, and how many are running under
// another copy. On an error it releases what it acquired.
func (m *middleware) claimEach(ctx context.Context, events []batchEvent, lease time.Duration) (mine []claimed, busy int, err error) {
	opts := []idem.ClaimOption{idem.WithLease(lease)}
	if m.cfg.TTL > 0 {
		opts = append(opts, idem.WithTTL(m.cfg.TTL))
	}
	tokens := map[string]int64{}
	// One batch claim per idem.MaxBatch events (a batch claim takes its
	// keys' locks in one global order, so two copies of one delivery
	// cannot deadlock); a failed one releases what the earlier ones took.
	for from := 0; from < len(events); from += idem.MaxBatch {
		chunk := events[from:min(from+idem.MaxBatch, len(events))]
		items := make([]idem.BatchItem, len(chunk))
		for i, ev := range chunk {
			items[i] = idem.BatchItem{Key: ev.key, EventType: ev.eventType}
		}
		cls, err := m.cfg.Client.ClaimBatch(ctx, m.cfg.Source, items, opts...)
		if err != nil {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), idem.DefaultRecordTimeout)
			for k, t := range tokens {
				_ = m.cfg.Client.Fail(rctx, m.cfg.Source, k, t, "released: the batch could not be claimed", true)
			}
			cancel()
			return nil, 0, err
		}
		for _, cl := range cls {
			switch cl.Outcome {
			case idem.Acquired:
				tokens[cl.Key] = cl.Token
			case idem.InProgress:
				busy++
			default:
				// Completed (or failed permanently, which no batch preset
				// records): ran before.
			}
		}
	}
	for _, ev := range events {
		if t, ok := tokens[ev.key]; ok {
			mine = append(mine, claimed{batchEvent: ev, token: t})
		}
	}
	return mine, busy, nil
}
