package idem_test

import (
	"slices"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

// splitKey inverts JoinKey: it splits at every unescaped sep and removes
// the escapes. That it recovers every part list proves JoinKey injective.
func splitKey(s string, sep byte) []string {
	var parts []string
	var cur []byte
	for i := 0; i < len(s); i++ {
		switch {
		case s[i] == '\\' && i+1 < len(s):
			i++
			cur = append(cur, s[i])
		case s[i] == sep:
			parts = append(parts, string(cur))
			cur = cur[:0]
		default:
			cur = append(cur, s[i])
		}
	}
	return append(parts, string(cur))
}

// FuzzCompositeKeys: two different part lists never give one key, for
// every composite key idem builds: JoinKey (idemhttp.JSONKey, Compose,
// the cache) over any number of parts, ScopeKey, and EffectKey, hashed or
// not (a hashed effect key never equals a plain one).
func FuzzCompositeKeys(f *testing.F) {
	for _, s := range [][4]string{{"a:b", "c", "a", "b:c"}, {"a\\", ":c", "a", "\\:c"}, {"", "", ":", ""},
		{"a|b", "c", "a", "b|c"}, {"", "alice|order-1", "alice", "order-1"}, {"sha256:" + strings.Repeat("ab", 32), "x", strings.Repeat("k", 510), "y"}} {
		f.Add(s[0], s[1], s[2], s[3], uint8(2), uint8(2))
	}
	f.Fuzz(func(t *testing.T, a, b, c, d string, n, m uint8) {
		all := []string{a, b, c, d}
		// Two lists of 1 to 4 parts, over the same or other strings.
		l1 := all[:1+int(n)%4]
		l2 := all[int(m)%4 : min(4, int(m)%4+1+int(m/4)%4)]
		j1, j2 := idem.JoinKey(l1[0], l1[1:]...), idem.JoinKey(l2[0], l2[1:]...)
		if got := splitKey(j1, ':'); !slices.Equal(got, l1) {
			t.Fatalf("JoinKey(%q) = %q splits back to %q", l1, j1, got)
		}
		if j1 == j2 && !slices.Equal(l1, l2) {
			t.Fatalf("JoinKey(%q) == JoinKey(%q) == %q", l1, l2, j1)
		}
		if !strings.ContainsAny(strings.Join(l1, ""), ":\\") && j1 != strings.Join(l1, ":") {
			t.Fatalf("JoinKey(%q) = %q, not the plain join of parts without ':' or '\\'", l1, j1)
		}
		if s1, s2 := idem.ScopeKey(a, b), idem.ScopeKey(c, d); s1 == s2 && (a != c || b != d) {
			t.Fatalf("ScopeKey(%q, %q) == ScopeKey(%q, %q) == %q", a, b, c, d, s1)
		}
		_, e1, err1 := idem.EffectKey("s", a, "mail")
		_, e2, err2 := idem.EffectKey("s", c, "mail")
		if err1 == nil && err2 == nil && e1 == e2 && a != c {
			t.Fatalf("EffectKey of %q and %q is %q for both", a, c, e1)
		}
	})
}

// TestCompositeKeysKeepTheirEncoding: keys stored by earlier versions are
// found again: parts without ':' or '\' join as before, a scope without
// '|' or '\' prefixes as before, and an effect key stays name/key.
func TestCompositeKeysKeepTheirEncoding(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ got, want string }{
		{idem.JoinKey("acme", "42", "orders/create"), "acme:42:orders/create"},
		{idem.JoinKey("urn:x", "1"), `urn\:x:1`},
		{idem.ScopeKey("c:0123abcd", "k|1"), "c:0123abcd|k|1"},
		{idem.ScopeKey("a|b", "c"), `a\|b|c`},
		{idem.ScopeKey("", "alice|order-1"), "|alice|order-1"}, // no principal: never "alice|order-1"
	} {
		if tc.got != tc.want {
			t.Errorf("got %q, want %q", tc.got, tc.want)
		}
	}
	if _, k, _ := idem.EffectKey("stripe", "evt_1", "mail"); k != "mail/evt_1" {
		t.Errorf("EffectKey: %q", k)
	}
}
