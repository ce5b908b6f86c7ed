package idem_test

import (
	"context"
	"errors"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// FuzzClaimInput: any source and key either claim fine or fail with
// ErrInvalidInput; never another error, never a panic, never half a row.
func FuzzClaimInput(f *testing.F) {
	for _, s := range [][2]string{{"stripe", "evt_1"}, {"", "k"}, {" ", "k"}, {"s", "\x00"}, {"s\xff", "k"},
		{"s", string(make([]byte, 600))}, {"é", "ключ"}, {"s", "'; DROP TABLE x; --"}} {
		f.Add(s[0], s[1])
	}
	pool := testdb.Pool(f, testdb.New(f), 4)
	c := testdb.Client(f, pool, nil)
	ctx := context.Background()
	f.Fuzz(func(t *testing.T, source, key string) {
		cl, err := c.Claim(ctx, source, key)
		switch {
		case err == nil:
			if cl.Outcome != idem.Acquired && cl.Outcome != idem.InProgress {
				t.Fatalf("%q/%q: %+v", source, key, cl)
			}
		case errors.Is(err, idem.ErrInvalidInput):
		default:
			t.Fatalf("%q/%q: unexpected error %v", source, key, err)
		}
	})
}
