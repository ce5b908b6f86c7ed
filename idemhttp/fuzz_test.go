package idemhttp_test

import (
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemhttp"
)

// FuzzIdempotencyKeyHeader: any header value parses to a key or an error,
// never a panic; a quoted key round-trips.
func FuzzIdempotencyKeyHeader(f *testing.F) {
	for _, s := range []string{`"abc"`, `abc`, `"a\"b"`, `"unterminated`, `"bad \x"`, `""`, `"x";param=1`, "\"\x7f\""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, v string) {
		r, _ := http.NewRequest("POST", "/", nil)
		r.Header.Set("Idempotency-Key", v)
		key, _, err := idemhttp.IdempotencyKeyHeader(r, nil)
		if err == nil && strings.TrimSpace(v) != "" && key == "" {
			t.Fatalf("%q: no key and no error", v)
		}
	})
}
