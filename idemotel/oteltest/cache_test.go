package oteltest_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/internal/testdb"
)

// TestCacheAnswerOnSpan: a claim answered by Config.Cache, without a
// round trip, says so on its span (idem.cached, an idem.cache.hit event)
// and has no query under it.
func TestCacheAnswerOnSpan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: s.tp, MeterProvider: s.mp})
	if err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(s.pool, &idem.Config{Tracer: tel, Cache: &idem.CacheConfig{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	work := func(context.Context) (any, error) { return "ok", nil }
	// The cache answers once its listener has been heard from: try fresh
	// keys until a database answer fills it and the next is the cache's.
	for i := range 200 {
		key := fmt.Sprint("cached-", i)
		for range 3 {
			if _, err := c.Do(ctx, "shop", key, work); err != nil {
				t.Fatal(err)
			}
		}
		spans := fromSDKs(s.rec.Ended())
		for _, cl := range find(spans, "idem.claim") {
			if cl.Attrs["idem.cached"] != "true" {
				continue
			}
			if _, ok := hasEvent(cl, "idem.cache.hit"); !ok || cl.Attrs["idem.outcome"] != "completed" {
				t.Fatalf("a cache answer's span: %v %v", cl.Attrs, cl.Events)
			}
			for _, q := range spans {
				if q.ParentID == cl.SpanID {
					t.Fatalf("a cache answer ran %s", q.Name)
				}
			}
			return
		}
		s.rec.Reset()
	}
	t.Fatal("no claim was answered by the cache in 200 keys")
}
