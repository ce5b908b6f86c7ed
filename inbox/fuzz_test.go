package inbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
)

// FuzzInboxOutcomes feeds any bytes through the inbox's complete and fail:
// a handler (in a real River worker) returns them as its result, or as
// the text of its error (permanent or not). Every event is completed or
// dead-lettered, River finalizes its job, and the handler runs no more
// than its attempts (MaxAttempts 2). size pads, one time in three, the
// result to about 1 MiB (at and over the limit). CI runs it briefly
// (.ci/run); `make fuzz` runs it longer.
func FuzzInboxOutcomes(f *testing.F) {
	for _, s := range [][]byte{[]byte(`{"a":1}`), []byte(`"\u0000"`), []byte(`"\ud800"`), []byte(`1e131072`)} {
		f.Add(s, uint8(0), uint16(0)) // results
	}
	for _, s := range [][]byte{[]byte("a\x00b"), []byte(strings.Repeat("x", 4095) + "é"[:1])} {
		f.Add(s, uint8(1), uint16(0)) // error texts
		f.Add(s, uint8(2), uint16(0)) // permanent ones
	}
	f.Add([]byte(`1`), uint8(0), uint16(3*40+1))
	f.Add([]byte(`1`), uint8(0), uint16(3*90+1))
	_, pool := setup(f)
	type want struct {
		result any
		err    error
	}
	var mu sync.Mutex
	wants := map[string]want{}
	runs := map[string]int{}
	in, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, DefaultMaxAttempts: 2, RepairEvery: -1,
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			mu.Lock()
			defer mu.Unlock()
			runs[d.Key]++
			w := wants[d.Key]
			return w.result, w.err
		}})
	if err != nil {
		f.Fatal(err)
	}
	start(f, in, 4, nil)
	ctx := context.Background()
	var n atomic.Int64
	f.Fuzz(func(t *testing.T, b []byte, mode uint8, size uint16) {
		key := fmt.Sprintf("f%d", n.Add(1))
		var w want
		switch mode % 3 {
		case 0:
			if size%3 == 1 {
				if pad := 1<<20 - 48 + int(size/3%97) - len(b); pad > 0 {
					b = append([]byte(`["`+strings.Repeat("x", pad)+`", `), append(b, ']')...)
				}
			}
			w.result = json.RawMessage(b)
		case 1:
			w.err = errors.New(string(b))
		case 2:
			w.err = idem.Permanent(errors.New(string(b)))
		}
		mu.Lock()
		wants[key] = w
		mu.Unlock()
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "fz", Key: key, Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(60 * time.Second)
		for {
			var state string
			if err := pool.QueryRow(ctx, `SELECT state::text FROM river_job WHERE args->>'key' = $1`, key).Scan(&state); err != nil {
				t.Fatal(err)
			}
			if state == "completed" || state == "discarded" || state == "cancelled" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%q (mode %d): the job is still %s", b, mode%3, state)
			}
			time.Sleep(10 * time.Millisecond)
		}
		var status string
		var dead bool
		if err := pool.QueryRow(ctx, `SELECT e.status, EXISTS (SELECT 1 FROM idem.holds h WHERE h.source = 'fz' AND h.key = $1 AND h.state = 'dead')
		    FROM idem.processed_events e WHERE e.source = 'fz' AND e.key = $1`, key).Scan(&status, &dead); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		ran := runs[key]
		mu.Unlock()
		switch mode % 3 {
		case 0:
			if status != "completed" || ran != 1 {
				t.Fatalf("%q: result: %s, ran %d times", b, status, ran)
			}
		case 1:
			if !dead || ran != 2 {
				t.Fatalf("%q: error: dead %v, ran %d times", b, dead, ran)
			}
		case 2:
			if !dead || ran != 1 {
				t.Fatalf("%q: permanent error: dead %v, ran %d times", b, dead, ran)
			}
		}
	})
}
