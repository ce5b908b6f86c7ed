package oteltest_test

import (
	"errors"
	"fmt"
	"net/http"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/internal/testdb"
)

// TestDecisionsOnServerSpan: idemhttp's decisions are events and
// attributes on the request's own server span: a signature refused (and
// why, in fixed words), a signature verified, a 409 while the first
// request still runs; and counted by answer.
func TestDecisionsOnServerSpan(t *testing.T) {
	t.Parallel()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	entered, release := make(chan struct{}), make(chan struct{})
	url := s.serve(t, idemhttp.Config{Verify: func(r *http.Request, body []byte) error {
		switch r.Header.Get("X-Sig") {
		case "good":
			return nil
		case "":
			return fmt.Errorf("%w: X-Sig", idemhttp.ErrSignatureMissing)
		}
		return errors.New("idemhttp: X-Sig " + secretToken + " does not match") // a verifier that quotes what it was sent
	}}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(entered)
		<-release
		w.WriteHeader(http.StatusCreated)
	}))
	send := func(sig string) int {
		req, _ := http.NewRequest("POST", url+"/orders", nil)
		req.Header.Set("Idempotency-Key", secretKey)
		req.Header.Set("Authorization", secretToken)
		if sig != "" {
			req.Header.Set("X-Sig", sig)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := send("forged"); code != http.StatusUnauthorized {
		t.Fatal(code)
	}
	if code := send(""); code != http.StatusBadRequest {
		t.Fatal(code)
	}
	done := make(chan int, 1)
	go func() { done <- send("good") }()
	<-entered
	if code := send("good"); code != http.StatusConflict {
		t.Fatal(code)
	}
	close(release)
	if code := <-done; code != http.StatusCreated {
		t.Fatal(code)
	}

	answers := map[string][]span{}
	for _, sp := range serverSpans(fromSDKs(s.rec.Ended())) {
		answers[sp.Attrs["idem.http.answer"]] = append(answers[sp.Attrs["idem.http.answer"]], sp)
	}
	if len(answers["refused"]) != 2 || len(answers["in_progress"]) != 1 || len(answers["ran"]) != 1 {
		t.Fatalf("server spans by answer: %v", answers)
	}
	reasons := map[string]bool{}
	for _, sp := range answers["refused"] {
		e, ok := hasEvent(sp, "idem.http.refused")
		if !ok {
			t.Fatalf("refused without its event: %v", sp.Events)
		}
		reasons[e.Attrs["idem.http.reason"]] = true
		if _, ok := hasEvent(sp, "idem.http.verified"); ok {
			t.Fatal("a refused delivery was verified")
		}
	}
	if !reasons[idemhttp.RefusedSignatureInvalid] || !reasons[idemhttp.RefusedSignatureMissing] {
		t.Fatalf("refusal reasons: %v", reasons)
	}
	for _, sp := range append(answers["ran"], answers["in_progress"]...) {
		if _, ok := hasEvent(sp, "idem.http.verified"); !ok {
			t.Fatalf("%s: no verified event: %v", sp.Attrs["idem.http.answer"], sp.Events)
		}
	}
	got := sums(collect(t, s))
	for k, want := range map[string]int64{
		"idem.http.answers{idem.http.answer=refused,idem.source=shop}":     2,
		"idem.http.answers{idem.http.answer=in_progress,idem.source=shop}": 1,
		"idem.claims{idem.outcome=in_progress,idem.source=shop}":           1,
	} {
		if got[k] != want {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], want, got)
		}
	}
	noSecrets(t, fromSDKs(s.rec.Ended()), collect(t, s), secretKey, secretToken)
}
