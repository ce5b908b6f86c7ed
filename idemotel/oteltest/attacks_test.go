package oteltest_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
)

// TestHostileKeysOnSpans: keys idem refuses (not UTF-8, a NUL, over 512
// bytes) still start a claim's span before the claim refuses them: with
// KeyPlain, what the span carries is valid UTF-8 of at most 512 bytes (an
// OTLP exporter drops a whole batch over one invalid string), and every
// span ends.
func TestHostileKeysOnSpans(t *testing.T) {
	t.Parallel()
	s := newStack(t, testdb.New(t), idemotel.KeyPlain)
	for _, key := range []string{"\xff\xfeorder", "a\x00b", strings.Repeat("é", 400), strings.Repeat("\xff", 600)} {
		_, err := s.client.Do(context.Background(), "shop", key, func(ctx context.Context) (any, error) { return nil, nil })
		if !errors.Is(err, idem.ErrInvalidInput) {
			t.Fatalf("key %q: %v", key, err)
		}
	}
	if started, ended := len(s.rec.Started()), len(s.rec.Ended()); started != ended {
		t.Fatalf("%d spans started, %d ended", started, ended)
	}
	for _, sp := range fromSDKs(s.rec.Ended()) {
		if !strings.HasPrefix(sp.Name, "idem.") {
			continue // otelpgx's: its query text, no key
		}
		for k, v := range sp.Attrs {
			if !utf8.ValidString(v) || len(v) > 512 {
				t.Errorf("span %s attribute %s: %q", sp.Name, k, v)
			}
		}
		if sp.Attrs["error.type"] != "invalid_input" {
			t.Errorf("span %s: error.type %q", sp.Name, sp.Attrs["error.type"])
		}
	}
}

// TestDeadlineEndsEverySpan: a Do whose context's deadline passes
// mid-work, and one whose context is cancelled before it starts, end every
// span they started, with error.type and a status that quotes no key.
func TestDeadlineEndsEverySpan(t *testing.T) {
	t.Parallel()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	_, err := s.client.Do(ctx, "shop", secretKey, func(ctx context.Context) (any, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal(err)
	}
	gone, cancel2 := context.WithCancel(context.Background())
	cancel2()
	if _, err := s.client.Do(gone, "shop", secretKey+"-2", func(ctx context.Context) (any, error) { return nil, nil }); err == nil {
		t.Fatal("a cancelled context claimed")
	}
	if started, ended := len(s.rec.Started()), len(s.rec.Ended()); started != ended {
		t.Fatalf("%d spans started, %d ended", started, ended)
	}
	spans := fromSDKs(s.rec.Ended())
	for _, name := range []string{"idem.work", "idem.do"} {
		for _, sp := range find(spans, name) {
			if sp.Attrs["error.type"] == "" || sp.Status == "" {
				t.Errorf("%s: error.type %q status %q", name, sp.Attrs["error.type"], sp.Status)
			}
		}
	}
	noSecrets(t, spans, collect(t, s), secretKey)
}

// TestInboxHostileTraceMetadata: a job whose idem_trace is not an object,
// or holds a traceparent that does not parse (metadata written by hand, or
// by another program), is processed as any other, with no link.
func TestInboxHostileTraceMetadata(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	if _, err := inbox.Migrate(ctx, s.pool, ""); err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(inbox.Config{Pool: s.pool, Idem: s.client, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		return nil, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	for key, trace := range map[string]string{
		"not-an-object": `"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"`,
		"bad-parent":    `{"traceparent": "00-zzzz-not-a-trace", "tracestate": "` + strings.Repeat("x=y,", 100) + `"}`,
		"wrong-types":   `{"traceparent": 42}`,
	} {
		a, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: key, Payload: []byte(`{}`)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.pool.Exec(ctx, `UPDATE river_job SET metadata = jsonb_set(metadata, '{idem_trace}', $1::jsonb) WHERE id = $2`, trace, a.JobID); err != nil {
			t.Fatal(err)
		}
	}
	s.rec.Reset()
	startWorker(t, in)
	waitUntil(t, "the three jobs processed", func() bool {
		n := 0
		for _, sp := range find(fromSDKs(s.rec.Ended()), "process ") {
			if sp.Attrs["idem.inbox.outcome"] == "processed" {
				n++
				if len(sp.Links) != 0 {
					t.Errorf("a hostile trace context was linked: %v", sp.Links)
				}
			}
		}
		return n == 3
	})
}
