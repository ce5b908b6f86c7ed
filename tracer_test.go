package idem_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// treeTracer records the operations it is told of as an indented tree,
// each under the operation whose context it started in.
type treeTracer struct {
	mu    sync.Mutex
	lines []string
	depth map[int]int
	next  atomic.Int64
}

type treeKey struct{}

func (t *treeTracer) TraceStart(ctx context.Context, d idem.TraceStartData) context.Context {
	parent, _ := ctx.Value(treeKey{}).(int)
	id := int(t.next.Add(1))
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.depth == nil {
		t.depth = map[int]int{}
	}
	t.depth[id] = t.depth[parent] + 1
	t.lines = append(t.lines, fmt.Sprintf("%s%s%s", strings.Repeat("  ", t.depth[parent]), d.Op, name(d.Name)))
	return context.WithValue(ctx, treeKey{}, id)
}

func name(n string) string {
	if n == "" || n == "work" {
		return ""
	}
	return " " + n
}

func (t *treeTracer) TraceEnd(ctx context.Context, d idem.TraceEndData) {
	if ctx.Value(treeKey{}) == nil {
		panic("TraceEnd without its start's context")
	}
	if d.Op == idem.OpClaim && d.Claim != nil {
		t.mu.Lock()
		t.lines = append(t.lines, fmt.Sprintf("  = %s", d.Claim.Outcome))
		t.mu.Unlock()
	}
}

func (t *treeTracer) take() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.Join(t.lines, "\n")
	t.lines = nil
	return s
}

type countObserver struct{ n atomic.Int64 }

func (o *countObserver) ObserveClaim(idem.ClaimObservation) { o.n.Add(1) }

// TestTracerSeam: the core's tracer sees Do around its claim, its work
// (whose effects are its children) and its completion; a duplicate's Do
// has a claim and no work; the Observer counts the same claims (one
// mechanism).
func TestTracerSeam(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 4)
	tr, obs := &treeTracer{}, &countObserver{}
	c := testdb.Client(t, pool, &idem.Config{Tracer: tr, Observer: obs})
	ctx := context.Background()
	work := func(ctx context.Context) (any, error) {
		_, err := c.Effect(ctx, "send_receipt", func(ctx context.Context) (any, error) { return "sent", nil })
		return "ok", err
	}
	if _, err := c.Do(ctx, "seam", "k1", work); err != nil {
		t.Fatal(err)
	}
	want := `do
  claim
  = acquired
  work
    effect send_receipt
      claim
  = acquired
      work
      complete
  complete`
	if got := tr.take(); got != want {
		t.Fatalf("new delivery:\n%s\nwant\n%s", got, want)
	}
	res, err := c.Do(ctx, "seam", "k1", work)
	if err != nil || !res.Replayed {
		t.Fatal(res, err)
	}
	if got, want := tr.take(), "do\n  claim\n  = completed"; got != want {
		t.Fatalf("duplicate:\n%s\nwant\n%s", got, want)
	}
	if n := obs.n.Load(); n != 3 {
		t.Fatalf("the Observer counted %d claims, want 3 (the tracer's)", n)
	}
}

// TestTracerSeamWait: a duplicate that waits for the original reports
// the wait under its claim.
func TestTracerSeamWait(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 6)
	tr := &treeTracer{}
	c := testdb.Client(t, pool, &idem.Config{Tracer: tr})
	plain := testdb.Client(t, pool, nil)
	ctx := context.Background()
	started, release := make(chan struct{}), make(chan struct{})
	done := make(chan error, 1)
	go func() {
		_, err := plain.Do(ctx, "seam", "w1", func(ctx context.Context) (any, error) {
			close(started)
			<-release
			return "first", nil
		})
		done <- err
	}()
	<-started
	go func() {
		// Released once the duplicate has been told the key is in progress.
		for !strings.Contains(tr.snapshot(), "wait") {
			time.Sleep(5 * time.Millisecond)
		}
		close(release)
	}()
	res, err := c.Do(ctx, "seam", "w1", func(ctx context.Context) (any, error) { return "second", nil }, idem.WithWait(time.Minute))
	if err != nil || !res.Replayed {
		t.Fatal(res, err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got, want := tr.take(), "do\n  claim\n    wait\n  = completed"; got != want {
		t.Fatalf("waited duplicate:\n%s\nwant\n%s", got, want)
	}
}

func (t *treeTracer) snapshot() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}
