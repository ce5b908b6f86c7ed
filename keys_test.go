package idem_test

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

func TestHashKey(t *testing.T) {
	t.Parallel()
	t.Run("order and nesting independent", func(t *testing.T) {
		a, err := idem.HashKey(map[string]any{"a": 1, "b": map[string]any{"y": []any{1, "x"}, "x": true}})
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		_ = json.Unmarshal([]byte(`{"b":{"x":true,"y":[1,"x"]},"a":1}`), &m)
		b, _ := idem.HashKey(m)
		if a != b {
			t.Fatalf("%s != %s", a, b)
		}
	})
	t.Run("numbers kept exactly", func(t *testing.T) {
		a, _ := idem.HashKey(map[string]any{"n": json.Number("12345678901234567891")})
		b, _ := idem.HashKey(map[string]any{"n": json.Number("12345678901234567892")})
		if a == b {
			t.Fatal("distinct large numbers hashed alike")
		}
	})
	t.Run("values distinguish", func(t *testing.T) {
		a, _ := idem.HashKey(map[string]any{"k": "1"})
		b, _ := idem.HashKey(map[string]any{"k": 1})
		if a == b {
			t.Fatal(`"1" and 1 hashed alike`)
		}
	})
	t.Run("bad input", func(t *testing.T) {
		for name, fields := range map[string]map[string]any{
			"nil":   nil,
			"empty": {},
			"func":  {"f": func() {}},
		} {
			if _, err := idem.HashKey(fields); !errors.Is(err, idem.ErrInvalidInput) {
				t.Errorf("%s: %v, want ErrInvalidInput", name, err)
			}
		}
		if _, err := idem.BucketedKey(map[string]any{"a": 1}, time.Now(), 0); !errors.Is(err, idem.ErrInvalidInput) {
			t.Errorf("zero window: %v", err)
		}
		if _, err := idem.BucketedKey(map[string]any{"_idem_bucket": 1}, time.Now(), time.Minute); !errors.Is(err, idem.ErrInvalidInput) {
			t.Errorf("reserved field: %v", err)
		}
	})
	t.Run("fingerprint parts are delimited", func(t *testing.T) {
		if idem.Fingerprint([]byte("ab"), []byte("c")) == idem.Fingerprint([]byte("a"), []byte("bc")) {
			t.Fatal("ambiguous fingerprint")
		}
	})
}

// FuzzHashKey: any JSON object hashes deterministically, independent of
// how it was written, to 64 hex characters, or fails with ErrInvalidInput.
func FuzzHashKey(f *testing.F) {
	for _, s := range []string{`{"a":1}`, `{"b":[1,2,{"c":null}],"a":"x"}`, `{"n":1e400}`, `{}`, `{"\u0000":"\ud800"}`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, doc string) {
		var m map[string]any
		if json.Unmarshal([]byte(doc), &m) != nil {
			return
		}
		k1, err := idem.HashKey(m)
		if err != nil {
			if !errors.Is(err, idem.ErrInvalidInput) {
				t.Fatalf("error %v is not ErrInvalidInput", err)
			}
			return
		}
		canon, err := idem.Canonical(m)
		if err != nil {
			t.Fatal(err)
		}
		var again map[string]any
		if err := json.Unmarshal(canon, &again); err != nil {
			t.Fatalf("canonical form %s does not parse: %v", canon, err)
		}
		k2, err := idem.HashKey(again)
		if err != nil || k1 != k2 || len(k1) != 64 {
			t.Fatalf("unstable key for %s: %s vs %s (%v)", doc, k1, k2, err)
		}
	})
}
