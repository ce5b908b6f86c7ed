package idem_test

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestValueBytes: DoValue and EffectValue with a []byte T store the bytes
// encoded (base64 in JSON, as encoding/json does), so binary bytes and
// bytes that look like a JSON object come back the same, on the call that
// ran and on every replay. Before, a []byte was stored as raw JSON: binary
// bytes were never stored (the effect ran, its value was gone), and
// `{"a":1}` failed to decode on every replay.
func TestValueBytes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	for name, want := range map[string][]byte{"binary": {0xff, 0x00, 0x01}, "json object": []byte(`{"a":1}`),
		"json string": []byte(`"s"`), "empty": {}} {
		t.Run(name, func(t *testing.T) {
			runs := 0
			for i := range 3 {
				got, err := idem.DoValue(ctx, c, "bytes", name, func(ctx context.Context) ([]byte, error) {
					runs++
					var eff []byte
					for range 2 {
						v, err := idem.EffectValue(ctx, c, "fetch", func(context.Context) ([]byte, error) { return want, nil })
						if err != nil || !bytes.Equal(v, want) {
							t.Fatalf("EffectValue: %q %v, want %q", v, err, want)
						}
						eff = v
					}
					return eff, nil
				})
				if err != nil || !bytes.Equal(got, want) {
					t.Fatalf("DoValue call %d: %q %v, want %q", i+1, got, err, want)
				}
			}
			if runs != 1 {
				t.Fatalf("the work ran %d times", runs)
			}
		})
	}
}

// TestEffectShortTTL: an event whose TTL (1 minute, with a lease of 30 s)
// is under the effects' lease (the default policy's, 2 minutes) runs its
// effect once, replayed after; with EffectLease over the TTL too. Before, the effect's claim was
// refused on every delivery ("lease 00:02:00 is longer than ttl
// 00:01:00"): the library chose both values and chose an invalid pair.
func TestEffectShortTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	for name, opts := range map[string][]idem.EffectOption{"policy lease": nil, "EffectLease": {idem.EffectLease(5 * time.Minute)}} {
		t.Run(name, func(t *testing.T) {
			effects := 0
			for range 2 {
				key := name
				res, err := c.Do(ctx, "short", key, func(ctx context.Context) (any, error) {
					for range 2 {
						if _, err := c.Effect(ctx, "send", func(context.Context) (any, error) { effects++; return 1, nil }, opts...); err != nil {
							return nil, err
						}
					}
					return nil, errors.New("fail the event, so that its retry replays the effect")
				}, idem.WithTTL(time.Minute), idem.WithLease(30*time.Second))
				if err == nil || !strings.Contains(err.Error(), "so that its retry") {
					t.Fatalf("%+v %v", res, err)
				}
			}
			if effects != 1 {
				t.Fatalf("the effect ran %d times", effects)
			}
		})
	}
}
