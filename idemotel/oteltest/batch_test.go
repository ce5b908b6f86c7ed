package oteltest_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/internal/testdb"
)

// TestClaimBatchOnSpanAndMetrics: a batch claim is one idem.claim_batch
// span (its size on it, its query under it, no key of any item), and each
// item counts as one claim by its outcome.
func TestClaimBatchOnSpanAndMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	s := newStack(t, testdb.New(t), idemotel.KeyHash)
	items := make([]idem.BatchItem, 10)
	for i := range items {
		items[i] = idem.BatchItem{Key: fmt.Sprint(secretKey, i)}
	}
	if _, err := s.client.ClaimBatch(ctx, "shop", items[:4]); err != nil {
		t.Fatal(err)
	}
	s.rec.Reset()
	if _, err := s.client.ClaimBatch(ctx, "shop", items); err != nil {
		t.Fatal(err)
	}
	spans := fromSDKs(s.rec.Ended())
	b := one(t, spans, "idem.claim_batch")
	if b.Attrs["idem.batch.size"] != "10" || b.Attrs["idem.source"] != "shop" {
		t.Fatalf("the batch's span: %v", b.Attrs)
	}
	queries := 0
	for _, q := range spans {
		if q.ParentID == b.SpanID {
			queries++
		}
	}
	if queries == 0 {
		t.Fatal("no query under the batch's span")
	}
	got := sums(collect(t, s))
	if a, c := got["idem.claims{idem.outcome=acquired,idem.source=shop}"], got["idem.claims{idem.outcome=in_progress,idem.source=shop}"]; a != 10 || c != 4 {
		t.Fatalf("claims counted: acquired %d (want 4 + 6), in progress %d (want 4): %v", a, c, got)
	}
	noSecrets(t, spans, collect(t, s), secretKey)
}
