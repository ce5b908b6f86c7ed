package receiver

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sync"
)

// Stub is an in-process stand-in for the payment provider (POST
// /v1/charges) and the mail API (POST /v1/emails). It honours
// Idempotency-Key the way Stripe does: a key seen before, with the same
// body, is answered with the first answer (Idempotent-Replayed: true) and
// charges or sends nothing; the same key with another body is refused
// (400); a key whose first request is still being handled is answered 409.
// A write without a key is refused (400), so a caller that forgets it is
// caught. It records every write, for tests and the demo to count.
type Stub struct {
	// Hook, when set, is called with every keyed write: before the stub
	// acts on it (done false) and after it acted but before it answers
	// (done true). A non-nil error answers 503 before acting (nothing
	// done) or 502 after it (done, but the caller is told it failed: a
	// proxy or network failure on the way back). Tests kill the caller
	// from here.
	Hook func(path, key, invoice string, done bool) error

	mu       sync.Mutex
	answers  map[string]stubAnswer // path + key -> first answer
	inflight map[string]bool
	writes   []StubWrite
	done     []StubWrite // charges made and emails sent
}

// StubWrite is one write the stub received (or acted on).
type StubWrite struct {
	Path, Key, Invoice, ID string
}

type stubAnswer struct {
	digest [32]byte
	body   []byte
}

// ServeHTTP implements http.Handler.
func (s *Stub) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || (r.URL.Path != "/v1/charges" && r.URL.Path != "/v1/emails") {
		http.NotFound(w, r)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var ref struct {
		Invoice string `json:"invoice"`
	}
	if json.Unmarshal(body, &ref) != nil {
		http.Error(w, `{"error":"body is not JSON"}`, http.StatusBadRequest)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		http.Error(w, `{"error":"Idempotency-Key is required"}`, http.StatusBadRequest)
		return
	}
	slot := r.URL.Path + " " + key
	digest := sha256.Sum256(body)

	s.mu.Lock()
	if s.answers == nil {
		s.answers, s.inflight = map[string]stubAnswer{}, map[string]bool{}
	}
	s.writes = append(s.writes, StubWrite{Path: r.URL.Path, Key: key, Invoice: ref.Invoice})
	if a, seen := s.answers[slot]; seen {
		s.mu.Unlock()
		if a.digest != digest {
			http.Error(w, `{"error":"Keys for idempotent requests can only be used with the same parameters they were first used with."}`, http.StatusBadRequest)
			return
		}
		w.Header().Set("Idempotent-Replayed", "true")
		w.Write(a.body)
		return
	}
	if s.inflight[slot] {
		s.mu.Unlock()
		http.Error(w, `{"error":"a request with this Idempotency-Key is in progress"}`, http.StatusConflict)
		return
	}
	s.inflight[slot] = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.inflight, slot)
		s.mu.Unlock()
	}()

	if s.Hook != nil {
		if err := s.Hook(r.URL.Path, key, ref.Invoice, false); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
	}
	s.mu.Lock()
	prefix := map[string]string{"/v1/charges": "ch", "/v1/emails": "msg"}[r.URL.Path]
	id := fmt.Sprintf("%s_%03d", prefix, len(s.done)+1)
	s.done = append(s.done, StubWrite{Path: r.URL.Path, Key: key, Invoice: ref.Invoice, ID: id})
	answer, _ := json.Marshal(map[string]string{"id": id})
	s.answers[slot] = stubAnswer{digest: digest, body: answer}
	s.mu.Unlock()
	if s.Hook != nil {
		if err := s.Hook(r.URL.Path, key, ref.Invoice, true); err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
	}
	w.Write(answer)
}

// Done returns the charges made (path "/v1/charges") or emails sent
// ("/v1/emails") for an invoice ("" for all).
func (s *Stub) Done(path, invoice string) []StubWrite {
	return s.filter(s.done, path, invoice)
}

// Writes returns every write received at path for an invoice ("" for all),
// replays and refusals included.
func (s *Stub) Writes(path, invoice string) []StubWrite {
	return s.filter(s.writes, path, invoice)
}

func (s *Stub) filter(list []StubWrite, path, invoice string) []StubWrite {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []StubWrite
	for _, w := range list {
		if w.Path == path && (invoice == "" || w.Invoice == invoice) {
			out = append(out, w)
		}
	}
	return out
}

// Forget drops the stored answers, as a provider does once its key
// retention has passed (Stripe keeps keys for 24 hours).
func (s *Stub) Forget() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.answers = map[string]stubAnswer{}
}
