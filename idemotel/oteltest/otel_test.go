package oteltest_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/internal/testdb"
)

// The key and a credential of the tests' requests: neither may appear on
// any span or data point (unless keys are opted in).
const (
	secretKey   = "order-for-alice@example.com"
	secretToken = "Bearer tok_s3cr3t_do_not_trace"
)

// testPrincipal is who the application's authentication says sent the
// tests' requests (idemhttp.Config.Scope).
const testPrincipal = "user-alice"

func principal(*http.Request) (string, error) { return testPrincipal, nil }

// stack is what an application runs: one TracerProvider (recorded) and
// MeterProvider (read by hand) shared by otelhttp, otelpgx and idemotel.
type stack struct {
	rec    *tracetest.SpanRecorder
	reader *sdkmetric.ManualReader
	tp     *sdktrace.TracerProvider
	mp     *sdkmetric.MeterProvider
	pool   *pgxpool.Pool
	client *idem.Client
	url    string
}

func newStack(t *testing.T, url string, keys idemotel.KeyMode) *stack {
	t.Helper()
	s := &stack{rec: tracetest.NewSpanRecorder(), reader: sdkmetric.NewManualReader(), url: url}
	s.tp = sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(s.rec))
	s.mp = sdkmetric.NewMeterProvider(sdkmetric.WithReader(s.reader))
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	cfg.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerProvider(s.tp))
	s.pool, err = pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.pool.Close)
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: s.tp, MeterProvider: s.mp, Keys: keys})
	if err != nil {
		t.Fatal(err)
	}
	s.client = testdb.Client(t, s.pool, &idem.Config{Tracer: tel})
	return s
}

// serve runs handler behind idemhttp and otelhttp, as an application does.
func (s *stack) serve(t *testing.T, cfg idemhttp.Config, handler http.Handler) string {
	t.Helper()
	cfg.Client, cfg.Source = s.client, "shop"
	if cfg.Scope == nil {
		cfg.Scope = principal
	}
	mw, err := idemhttp.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(otelhttp.NewHandler(mw(handler), "POST /orders", otelhttp.WithTracerProvider(s.tp)))
	t.Cleanup(srv.Close)
	return srv.URL
}

func post(t *testing.T, url, key string) (int, string) {
	t.Helper()
	req, err := http.NewRequest("POST", url+"/orders", strings.NewReader(`{"item":"book"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("Authorization", secretToken)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// serverSpans returns the recorded server spans, in start order.
func serverSpans(spans []span) []span {
	var out []span
	for _, s := range spans {
		if s.Kind == "server" {
			out = append(out, s)
		}
	}
	return out
}

// mustParent fails unless child's parent is a span named parent.
func mustParent(t *testing.T, spans []span, child span, parent string) {
	t.Helper()
	p, ok := parentOf(spans, child)
	if !ok || !(p.Name == parent || strings.HasSuffix(parent, " ") && strings.HasPrefix(p.Name, parent)) {
		t.Fatalf("%s's parent is %q, want %q\n%s", child.Name, p.Name, parent, render(spans))
	}
}

func one(t *testing.T, spans []span, name string) span {
	t.Helper()
	f := find(spans, name)
	if len(f) != 1 {
		t.Fatalf("%d spans %q, want 1\n%s", len(f), name, render(spans))
	}
	return f[0]
}

func hasEvent(s span, name string) (event, bool) {
	for _, e := range s.Events {
		if e.Name == name {
			return e, true
		}
	}
	return event{}, false
}

// TestSpanTrees: otelhttp, otelpgx and idemotel on one TracerProvider. A
// new delivery nests server > idem.do > idem.claim > pgx query, and
// idem.do > idem.work > idem.effect; its duplicate's spans say replayed
// and have no work; the metrics count both. No key and no credential
// appears anywhere.
func TestSpanTrees(t *testing.T) {
	t.Parallel()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	url := s.serve(t, idemhttp.Config{}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := s.client.Effect(r.Context(), "send_receipt", func(ctx context.Context) (any, error) { return "sent", nil }); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	post(t, url, "warm-up") // the pool's connections and the schema check, out of the trees
	s.rec.Reset()

	if code, body := post(t, url, secretKey); code != http.StatusCreated {
		t.Fatal(code, body)
	}
	first := fromSDKs(s.rec.Ended())
	s.rec.Reset()
	if code, body := post(t, url, secretKey); code != http.StatusCreated {
		t.Fatal(code, body)
	}
	second := fromSDKs(s.rec.Ended())

	// The new delivery.
	srv := one(t, serverSpans(first), "POST")
	do := one(t, first, "idem.do")
	mustParent(t, first, do, "POST")
	claim := find(first, "idem.claim")[0]
	mustParent(t, first, claim, "idem.do")
	var underClaim bool
	for _, q := range first {
		if q.Kind == "client" && q.Attrs["db.system.name"] == "postgresql" && q.ParentID == claim.SpanID {
			underClaim = true
		}
	}
	if !underClaim {
		t.Fatalf("no pgx query span under the claim\n%s", render(first))
	}
	var work span
	for _, w := range find(first, "idem.work") {
		if w.ParentID == do.SpanID {
			work = w
		}
	}
	if work.Name == "" {
		t.Fatalf("no idem.work under idem.do\n%s", render(first))
	}
	effect := one(t, first, "idem.effect")
	if effect.ParentID != work.SpanID {
		t.Fatalf("the effect is not under the work\n%s", render(first))
	}
	if effect.Attrs["idem.effect.name"] != "send_receipt" || do.Attrs["idem.outcome"] != "acquired" || do.Attrs["idem.replayed"] != "false" {
		t.Fatalf("attributes: effect %v, do %v", effect.Attrs, do.Attrs)
	}
	if srv.Attrs["idem.http.answer"] != "ran" {
		t.Fatalf("server span: %v", srv.Attrs)
	}
	if _, ok := hasEvent(srv, "idem.http.answered"); !ok {
		t.Fatalf("server span events: %v", srv.Events)
	}
	if len(serverSpans(first)) != 1 {
		t.Fatalf("%d server spans for one request: idemhttp must not start its own", len(serverSpans(first)))
	}

	// The duplicate.
	srv2 := one(t, serverSpans(second), "POST")
	do2 := one(t, second, "idem.do")
	mustParent(t, second, do2, "POST")
	if do2.Attrs["idem.replayed"] != "true" || do2.Attrs["idem.outcome"] != "completed" {
		t.Fatalf("the duplicate's idem.do: %v", do2.Attrs)
	}
	if w := find(second, "idem.work"); len(w) != 0 {
		t.Fatalf("the duplicate ran work\n%s", render(second))
	}
	if e, ok := hasEvent(srv2, "idem.http.replayed"); !ok || e.Attrs["idem.http.reason"] != idemhttp.ReplayStored {
		t.Fatalf("the duplicate's server span events: %v", srv2.Events)
	}
	if srv2.Attrs["idem.http.answer"] != "replayed" || srv2.Attrs["idem.replayed"] != "true" {
		t.Fatalf("the duplicate's server span: %v", srv2.Attrs)
	}

	// Metrics: the claims by outcome, their duration, the answers.
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	got := sums(rm)
	for k, want := range map[string]int64{
		"idem.claims{idem.outcome=acquired,idem.source=shop}":           2, // warm-up, the new delivery
		"idem.claims{idem.outcome=completed,idem.source=shop}":          1,
		"idem.claims{idem.outcome=acquired,idem.source=shop/effects}":   2,
		"idem.http.answers{idem.http.answer=ran,idem.source=shop}":      2,
		"idem.http.answers{idem.http.answer=replayed,idem.source=shop}": 1,
		"idem.claim.duration{idem.outcome=completed,idem.source=shop}":  1, // a count
	} {
		if got[k] != want {
			t.Errorf("%s = %d, want %d (all: %v)", k, got[k], want, got)
		}
	}

	all := append(first, second...)
	noSecrets(t, all, rm, secretKey, idem.ScopeKey(testPrincipal, secretKey), secretToken)
	if do.Attrs["idem.key.hash"] == "" || do.Attrs["idem.key"] != "" {
		t.Fatalf("the key's hash, not the key: %v", do.Attrs)
	}
	writeTree(t, "new delivery", render(inTrace(first, srv.TraceID)))
	writeTree(t, "duplicate", render(inTrace(second, srv2.TraceID)))
}

func authRequest() *http.Request {
	r := httptest.NewRequest("POST", "/orders", nil)
	r.Header.Set("Authorization", secretToken)
	return r
}

// sums flattens counters (their sums) and histograms (their counts) into
// name{attributes} = value.
func sums(rm metricdata.ResourceMetrics) map[string]int64 {
	out := map[string]int64{}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					out[m.Name+setText(p.Attributes)] += p.Value
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					out[m.Name+setText(p.Attributes)] += int64(p.Count)
				}
			}
		}
	}
	return out
}

func setText(s attribute.Set) string {
	var parts []string
	for _, kv := range s.ToSlice() {
		parts = append(parts, string(kv.Key)+"="+kv.Value.Emit())
	}
	return "{" + strings.Join(parts, ",") + "}"
}

// collect reads the stack's metrics.
func collect(t *testing.T, s *stack) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	return rm
}

// noSecrets checks every recorded span's name, attributes, events, status
// and every data point's attributes for each secret.
func noSecrets(t *testing.T, spans []span, rm metricdata.ResourceMetrics, secrets ...string) {
	t.Helper()
	check := func(where, text string) {
		for _, sec := range secrets {
			if strings.Contains(text, sec) {
				t.Errorf("%s holds %q: %s", where, sec, text)
			}
		}
	}
	for _, s := range spans {
		check("span name", s.Name)
		check("span "+s.Name+" status", s.Status)
		for k, v := range s.Attrs {
			check("span "+s.Name+" attribute "+k, v)
		}
		for _, e := range s.Events {
			check("span "+s.Name+" event", e.Name)
			for k, v := range e.Attrs {
				check("span "+s.Name+" event "+e.Name+" attribute "+k, v)
			}
		}
	}
	for _, sm := range rm.ScopeMetrics {
		for _, m := range sm.Metrics {
			var sets []attribute.Set
			switch d := m.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					sets = append(sets, p.Attributes)
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					sets = append(sets, p.Attributes)
				}
			case metricdata.Sum[float64]:
				for _, p := range d.DataPoints {
					sets = append(sets, p.Attributes)
				}
			case metricdata.Histogram[int64]:
				for _, p := range d.DataPoints {
					sets = append(sets, p.Attributes)
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					sets = append(sets, p.Attributes)
				}
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					sets = append(sets, p.Attributes)
				}
			default:
				t.Errorf("metric %s: data %T not checked", m.Name, m.Data)
			}
			for _, set := range sets {
				check("metric "+m.Name, setText(set))
			}
		}
	}
}

// TestSpanWaitedDuplicate: a duplicate that arrives while the first
// request runs waits for it (idemhttp.Config.Wait): its claim has an
// idem.wait child, its server span an idem.waited event, and it is
// answered with the first one's stored answer.
func TestSpanWaitedDuplicate(t *testing.T) {
	t.Parallel()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	release := make(chan struct{})
	var once sync.Once
	url := s.serve(t, idemhttp.Config{Wait: time.Minute}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Idempotency-Key") == secretKey {
			<-release
		}
		w.WriteHeader(http.StatusCreated)
	}))
	post(t, url, "warm-up")
	s.rec.Reset()
	done := make(chan int, 1)
	go func() { code, _ := post(t, url, secretKey); done <- code }()
	waitStarted(t, s.rec, "idem.work", 1)
	go func() {
		waitStarted(t, s.rec, "idem.wait", 1) // the duplicate waits: let the first finish
		once.Do(func() { close(release) })
	}()
	if code, body := post(t, url, secretKey); code != http.StatusCreated {
		t.Fatal(code, body)
	}
	if code := <-done; code != http.StatusCreated {
		t.Fatal(code)
	}
	spans := fromSDKs(s.rec.Ended())
	wait := one(t, spans, "idem.wait")
	mustParent(t, spans, wait, "idem.claim")
	if wait.Attrs["idem.outcome"] != "completed" {
		t.Fatalf("the wait ended with %v", wait.Attrs)
	}
	dup := inTrace(spans, wait.TraceID)
	srv := one(t, serverSpans(dup), "POST")
	if _, ok := hasEvent(srv, "idem.waited"); !ok || srv.Attrs["idem.http.answer"] != "replayed" {
		t.Fatalf("the waited duplicate's server span: %v %v", srv.Attrs, srv.Events)
	}
	if len(find(dup, "idem.work")) != 0 {
		t.Fatalf("the waited duplicate ran work\n%s", render(dup))
	}
	var rm metricdata.ResourceMetrics
	if err := s.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	noSecrets(t, spans, rm, secretKey, secretToken)
	writeTree(t, "waited duplicate", render(dup))
}

// waitStarted waits until n spans named name have started.
func waitStarted(t *testing.T, rec *tracetest.SpanRecorder, name string, n int) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		c := 0
		for _, s := range rec.Started() {
			if s.Name() == name {
				c++
			}
		}
		if c >= n {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no %d %q spans started", n, name)
}

// TestKeysOptIn: with Config.Keys KeyPlain the key is on the spans (and
// still on no data point); with KeyOmit neither it nor its hash is.
func TestKeysOptIn(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	for _, mode := range []idemotel.KeyMode{idemotel.KeyPlain, idemotel.KeyOmit} {
		s := newStack(t, url, mode)
		if _, err := s.client.Do(context.Background(), "shop", fmt.Sprint(secretKey, mode), func(ctx context.Context) (any, error) { return nil, nil }); err != nil {
			t.Fatal(err)
		}
		spans := fromSDKs(s.rec.Ended())
		do := one(t, spans, "idem.do")
		switch mode {
		case idemotel.KeyPlain:
			if do.Attrs["idem.key"] != fmt.Sprint(secretKey, mode) {
				t.Fatalf("KeyPlain: %v", do.Attrs)
			}
		case idemotel.KeyOmit:
			if _, ok := do.Attrs["idem.key"]; ok {
				t.Fatalf("KeyOmit: %v", do.Attrs)
			}
			if _, ok := do.Attrs["idem.key.hash"]; ok {
				t.Fatalf("KeyOmit: %v", do.Attrs)
			}
		}
		var rm metricdata.ResourceMetrics
		if err := s.reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		noSecrets(t, nil, rm, secretKey)
	}
	if _, err := idemotel.New(&idemotel.Config{Keys: 7}); err == nil {
		t.Fatal("KeyMode 7 accepted")
	}
}
