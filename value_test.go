package idem_test

import (
	"bytes"
	"context"
	"testing"

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
