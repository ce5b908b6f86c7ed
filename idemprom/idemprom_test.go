package idemprom_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

const secret = "It's a Secret to Everybody"

// setup: metrics on a fresh registry, a client over a fresh database that
// reports to them, and a GitHub webhook endpoint behind idemhttp whose
// handler waits for release when the delivery's body says "slow".
func setup(t *testing.T) (*prometheus.Registry, *idem.Client, *httptest.Server, chan struct{}) {
	t.Helper()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg)
	if err != nil {
		t.Fatal(err)
	}
	pool := testdb.Pool(t, testdb.New(t), 8)
	client, err := idem.New(pool, &idem.Config{Observer: m})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idemhttp.New(idemhttp.Config{Client: client, Observer: m}.Apply(idemhttp.GitHub(secret)))
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-GitHub-Event") == "slow" {
			<-release
		}
		w.WriteHeader(http.StatusOK)
	})))
	t.Cleanup(srv.Close)
	return reg, client, srv, release
}

func deliver(t *testing.T, srv *httptest.Server, id, event, sig string) int {
	t.Helper()
	body := `{"action":"opened"}`
	req, err := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	if id != "" {
		req.Header.Set("X-GitHub-Delivery", id)
	}
	req.Header.Set("X-GitHub-Event", event)
	if sig == "" {
		mac := hmac.New(sha256.New, []byte(secret))
		mac.Write([]byte(body))
		sig = "sha256=" + hex.EncodeToString(mac.Sum(nil))
	}
	req.Header.Set("X-Hub-Signature-256", sig)
	resp, err := (&http.Client{Timeout: 10 * time.Second}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func TestMetrics(t *testing.T) {
	t.Parallel()
	reg, client, srv, release := setup(t)
	claims := func(outcome string) float64 {
		return value(t, reg, "idem_claims_total", map[string]string{"source": "github", "outcome": outcome})
	}
	answers := func(a idemhttp.Answer) float64 {
		return value(t, reg, "idem_http_answers_total", map[string]string{"source": "github", "answer": string(a)})
	}

	t.Run("first delivery runs, its duplicate is counted", func(t *testing.T) {
		if got := deliver(t, srv, "d-1", "push", ""); got != http.StatusOK {
			t.Fatalf("first delivery: %d", got)
		}
		if got := deliver(t, srv, "d-1", "push", ""); got != http.StatusOK {
			t.Fatalf("duplicate: %d", got)
		}
		if claims("acquired") != 1 || claims("completed") != 1 {
			t.Fatalf("claims acquired %v completed %v, want 1 and 1", claims("acquired"), claims("completed"))
		}
		if answers(idemhttp.AnswerRan) != 1 || answers(idemhttp.AnswerReplayed) != 1 {
			t.Fatalf("answers ran %v replayed %v, want 1 and 1", answers(idemhttp.AnswerRan), answers(idemhttp.AnswerReplayed))
		}
	})

	t.Run("a duplicate while the first runs is in_progress", func(t *testing.T) {
		done := make(chan int)
		go func() { done <- deliver(t, srv, "d-slow", "slow", "") }()
		deadline := time.Now().Add(10 * time.Second)
		for claims("acquired") < 2 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if got := deliver(t, srv, "d-slow", "slow", ""); got != http.StatusConflict {
			t.Fatalf("duplicate of a running delivery: %d, want 409", got)
		}
		close(release)
		if got := <-done; got != http.StatusOK {
			t.Fatalf("slow delivery: %d", got)
		}
		if claims("in_progress") != 1 || answers(idemhttp.AnswerInProgress) != 1 {
			t.Fatalf("in_progress: claims %v answers %v, want 1 and 1", claims("in_progress"), answers(idemhttp.AnswerInProgress))
		}
	})

	t.Run("forged and keyless deliveries claim nothing", func(t *testing.T) {
		before := claims("acquired") + claims("completed") + claims("in_progress")
		if got := deliver(t, srv, "d-2", "push", "sha256="+strings.Repeat("0", 64)); got != http.StatusUnauthorized {
			t.Fatalf("forged: %d, want 401", got)
		}
		if got := deliver(t, srv, "", "push", ""); got != http.StatusBadRequest {
			t.Fatalf("no delivery id: %d, want 400", got)
		}
		if answers(idemhttp.AnswerRefused) != 1 || answers(idemhttp.AnswerBadRequest) != 1 {
			t.Fatalf("answers refused %v bad_request %v, want 1 and 1", answers(idemhttp.AnswerRefused), answers(idemhttp.AnswerBadRequest))
		}
		if after := claims("acquired") + claims("completed") + claims("in_progress"); after != before {
			t.Fatalf("claims moved from %v to %v", before, after)
		}
	})

	t.Run("a claim that fails is an error", func(t *testing.T) {
		_, err := client.Claim(context.Background(), "github", " ")
		if !errors.Is(err, idem.ErrInvalidInput) {
			t.Fatalf("blank key: %v", err)
		}
		if claims(idemprom.OutcomeError) != 1 {
			t.Fatalf("error claims %v, want 1", claims(idemprom.OutcomeError))
		}
	})
}

func TestNew(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	if _, err := idemprom.New(reg); err != nil {
		t.Fatal(err)
	}
	var already prometheus.AlreadyRegisteredError
	if _, err := idemprom.New(reg); !errors.As(err, &already) {
		t.Fatalf("second New on one registry: %v, want prometheus.AlreadyRegisteredError", err)
	}
	if _, err := idemprom.New(nil); err == nil || !strings.Contains(err.Error(), "Registerer") {
		t.Fatalf("nil registerer: %v", err)
	}
}

// value reads a counter from what reg exposes (0 when the series is absent).
func value(t *testing.T, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if labels[l.GetName()] != l.GetValue() {
					continue series
				}
			}
			return m.GetCounter().GetValue()
		}
	}
	return 0
}
