package idemhttp_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// TestJSONKey: keys from JSON fields, table-driven: paths that hold a
// string or an integer give the key (several joined with ":"); a missing
// path, null, an empty string, an object, an array, a boolean, a
// fraction, a body that is not JSON, or a key over 512 bytes are
// ErrKeyField errors naming the path, never an empty key. A megabyte
// payload with the id at its end, and deep nesting, work.
func TestJSONKey(t *testing.T) {
	t.Parallel()
	big := `{"pad":"` + strings.Repeat("x", 1<<20) + `","data":{"object":{"id":"in_big"}}}`
	deep := strings.Repeat(`{"a":`, 200) + `"deep"` + strings.Repeat(`}`, 200)
	for _, tc := range []struct {
		name, body string
		typePath   string
		paths      []string
		key, typ   string
		problem    string // the error's text, "" for none
	}{
		{"stripe-like", `{"id":"evt_1","type":"invoice.paid","data":{"object":{"id":"in_1"}}}`, "type", []string{"data.object.id"}, "in_1", "invoice.paid", ""},
		{"two fields", `{"shop":"acme","order":{"id":42}}`, "", []string{"shop", "order.id"}, "acme:42", "", ""},
		{"array index", `{"items":[{"sku":"a-1"},{"sku":"b-2"}]}`, "", []string{"items.1.sku"}, "b-2", "", ""},
		{"negative integer", `{"n":-7}`, "", []string{"n"}, "-7", "", ""},
		{"unicode", `{"id":"zürich-☕"}`, "", []string{"id"}, "zürich-☕", "", ""},
		{"type absent is no type", `{"id":"x"}`, "type", []string{"id"}, "x", "", ""},
		{"type not a string is no type", `{"id":"x","type":5}`, "type", []string{"id"}, "x", "", ""},
		{"huge payload", big, "", []string{"data.object.id"}, "in_big", "", ""},
		{"deep nesting", deep, "", []string{strings.TrimSuffix(strings.Repeat("a.", 200), ".")}, "deep", "", ""},
		{"missing", `{"data":{}}`, "", []string{"data.object.id"}, "", "", `key field "data.object.id": not in the body`},
		{"second missing", `{"shop":"acme"}`, "", []string{"shop", "order.id"}, "", "", `key field "order.id": not in the body`},
		{"null", `{"id":null}`, "", []string{"id"}, "", "", `key field "id": null`},
		{"empty string", `{"id":"  "}`, "", []string{"id"}, "", "", `key field "id": an empty string`},
		{"object", `{"id":{"a":1}}`, "", []string{"id"}, "", "", `key field "id": an object`},
		{"array", `{"id":[1]}`, "", []string{"id"}, "", "", `key field "id": an array`},
		{"boolean", `{"id":true}`, "", []string{"id"}, "", "", `key field "id": a boolean`},
		{"fraction", `{"id":1.5}`, "", []string{"id"}, "", "", `key field "id": a number with a fraction or exponent (1.5)`},
		{"exponent", `{"id":1e3}`, "", []string{"id"}, "", "", `a number with a fraction or exponent`},
		{"not JSON", `id=1`, "", []string{"id"}, "", "", "the body is not JSON"},
		{"empty body", ``, "", []string{"id"}, "", "", "the body is not JSON"},
		{"truncated", `{"id":"x"`, "", []string{"id"}, "", "", "the body is not JSON"},
		{"no path", `{"id":"x"}`, "", nil, "", "", "no path"},
		{"too long", `{"id":"` + strings.Repeat("k", 600) + `"}`, "", []string{"id"}, "", "", "the key would be 600 bytes, over idem's 512"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key, typ, err := idemhttp.JSONKey(tc.typePath, tc.paths...)(httptest.NewRequest("POST", "/", nil), []byte(tc.body))
			if tc.problem == "" {
				if err != nil || key != tc.key || typ != tc.typ {
					t.Fatalf("got %q %q %v, want %q %q", key, typ, err, tc.key, tc.typ)
				}
				return
			}
			var fe *idemhttp.KeyFieldError
			if !errors.Is(err, idemhttp.ErrKeyField) || !errors.As(err, &fe) || !strings.Contains(err.Error(), tc.problem) || key != "" {
				t.Fatalf("got %q %v, want an ErrKeyField error with %q", key, err, tc.problem)
			}
		})
	}
}

// TestComposeKey: a key from a header and a JSON field; a missing part is
// an error naming its position.
func TestComposeKey(t *testing.T) {
	t.Parallel()
	k := idemhttp.Compose(idemhttp.HeaderKey("X-Topic", "X-Shop"), idemhttp.JSONKey("", "id"))
	r := httptest.NewRequest("POST", "/", nil)
	r.Header.Set("X-Shop", "acme.example")
	r.Header.Set("X-Topic", "orders/create")
	if key, typ, err := k(r, []byte(`{"id":12}`)); err != nil || key != "acme.example:12" || typ != "orders/create" {
		t.Fatalf("%q %q %v", key, typ, err)
	}
	r.Header.Del("X-Shop")
	if _, _, err := k(r, []byte(`{"id":12}`)); !errors.Is(err, idemhttp.ErrKeyField) || !strings.Contains(err.Error(), "part 1 of 2") {
		t.Fatalf("missing header: %v", err)
	}
}

// TestJSONFingerprint: only the selected fields count, in canonical form.
func TestJSONFingerprint(t *testing.T) {
	t.Parallel()
	fp := idemhttp.JSONFingerprint("amount", "customer")
	r := httptest.NewRequest("POST", "/", nil)
	a := fp(r, []byte(`{"amount":4200,"customer":{"id":"c1","tier":"gold"},"sent_at":"10:00"}`))
	same := []string{
		`{"customer":{"tier":"gold","id":"c1"},"amount":4200,"sent_at":"10:05","retry":1}`, // reordered, another field added
		`{ "amount" : 4200 , "customer" : { "id" : "c1" , "tier" : "gold" } }`,
	}
	for _, b := range same {
		if fp(r, []byte(b)) != a {
			t.Errorf("%s fingerprints differently", b)
		}
	}
	for _, b := range []string{`{"amount":4201,"customer":{"id":"c1","tier":"gold"}}`, `{"customer":{"id":"c1","tier":"gold"}}`, `not json`} {
		if fp(r, []byte(b)) == a {
			t.Errorf("%s fingerprints the same", b)
		}
	}
}

// TestJSONKeyOverHTTP: the middleware with a JSON key: the first delivery
// runs, its duplicate (fields reordered and one added, under
// JSONFingerprint) is replayed, a body without the field is 400 and runs
// nothing.
func TestJSONKeyOverHTTP(t *testing.T) {
	t.Parallel()
	runs := 0
	srv, _ := setup(t, idemhttp.Config{Source: "orders", Key: idemhttp.JSONKey("type", "data.object.id"),
		Fingerprint: idemhttp.JSONFingerprint("data.object")}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.Write([]byte("booked\n"))
	}))
	first := send(t, srv, "POST", "/", `{"type":"order.paid","data":{"object":{"id":"o_1","total":10}}}`, nil)
	dup := send(t, srv, "POST", "/", `{"sent":"later","data":{"object":{"total":10,"id":"o_1"}},"type":"order.paid"}`, nil)
	if first.status != 200 || dup.status != 200 || dup.header.Get(idemhttp.ReplayedHeader) != "true" || runs != 1 {
		t.Fatalf("first %d, duplicate %d %v, runs %d", first.status, dup.status, dup.header, runs)
	}
	bad := send(t, srv, "POST", "/", `{"type":"order.paid","data":{}}`, nil)
	requireProblem(t, bad, 400)
	if !strings.Contains(bad.body, `key field \"data.object.id\": not in the body`) || runs != 1 {
		t.Fatalf("missing field: %s, runs %d", bad.body, runs)
	}
}

// TestJSONKeysCannotCollide: two events whose fields hold ":" (URN ids,
// tenant names) have different keys, through JSONKey and Compose, and
// over HTTP each runs once (the second is not replayed the first one's
// answer, nor answered 422); fields without ":" or "\" keep the key a
// plain join gives (keys stored by earlier versions still match), and one
// path is its value as it is.
func TestJSONKeysCannotCollide(t *testing.T) {
	t.Parallel()
	r := httptest.NewRequest("POST", "/", nil)
	two := idemhttp.JSONKey("", "tenant", "id")
	bodies := []string{`{"tenant":"a:b","id":"c"}`, `{"tenant":"a","id":"b:c"}`, `{"tenant":"a\\","id":":c"}`, `{"tenant":"a","id":"\\:c"}`}
	seen := map[string]string{}
	for _, b := range bodies {
		key, _, err := two(r, []byte(b))
		if err != nil {
			t.Fatal(err)
		}
		if other, dup := seen[key]; dup {
			t.Fatalf("%s and %s share the key %q", other, b, key)
		}
		seen[key] = b
	}
	if key, _, _ := two(r, []byte(`{"tenant":"acme","id":42}`)); key != "acme:42" {
		t.Fatalf("plain fields: %q, want the plain join acme:42", key)
	}
	if key, _, _ := idemhttp.JSONKey("", "id")(r, []byte(`{"id":"urn:evt:1"}`)); key != "urn:evt:1" {
		t.Fatalf("one path: %q, want the value as it is", key)
	}
	composed := idemhttp.Compose(idemhttp.HeaderKey("", "X-Tenant"), idemhttp.JSONKey("", "id"))
	r1 := httptest.NewRequest("POST", "/", nil)
	r1.Header.Set("X-Tenant", "a:b")
	r2 := httptest.NewRequest("POST", "/", nil)
	r2.Header.Set("X-Tenant", "a")
	k1, _, _ := composed(r1, []byte(`{"id":"c"}`))
	k2, _, _ := composed(r2, []byte(`{"id":"b:c"}`))
	if k1 == k2 {
		t.Fatalf("Compose: two events share the key %q", k1)
	}

	runs := 0
	srv, _ := setup(t, idemhttp.Config{Source: "tenants", Key: two}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.Write([]byte("done\n"))
	}))
	for _, b := range bodies[:2] {
		res := send(t, srv, "POST", "/", b, nil)
		if res.status != 200 || res.header.Get(idemhttp.ReplayedHeader) == "true" {
			t.Fatalf("%s: %d %v", b, res.status, res.header)
		}
	}
	if runs != 2 {
		t.Fatalf("runs %d, want one per event", runs)
	}
}

// TestGuardKeysCannotCollide: an event type with a newline cannot make
// its (type, body) pair hash like another; a header's event type keeps
// the guard key earlier versions stored.
func TestGuardKeysCannotCollide(t *testing.T) {
	t.Parallel()
	if idemhttp.GuardKey("a\nb", []byte("c")) == idemhttp.GuardKey("a", []byte("b\nc")) {
		t.Fatal(`("a\nb", "c") and ("a", "b\nc") share a guard key`)
	}
	sum := sha256.Sum256([]byte("push\n{}"))
	if idemhttp.GuardKey("push", []byte("{}")) != hex.EncodeToString(sum[:]) {
		t.Fatal("the guard key of a header's event type changed")
	}
}

// TestJSONFingerprintNumbers: a number is compared by its value, so a
// sender or proxy that re-serializes 1 as 1.0 (or 1e0, 10E-1) is not a
// mismatch; different values stay different, however large or precise;
// numbers written in the shortest plain form fingerprint as before.
func TestJSONFingerprintNumbers(t *testing.T) {
	t.Parallel()
	fp := idemhttp.JSONFingerprint("n")
	r := httptest.NewRequest("POST", "/", nil)
	of := func(n string) string { return fp(r, []byte(`{"n":`+n+`}`)) }
	for _, same := range [][]string{{"1", "1.0", "1e0", "10E-1", "1.000", "0.1e1", "100e-2"}, {"0", "-0", "0.0", "0e5"},
		{"0.1", "0.10", "1e-1", "0.01e1"}, {"-2.5", "-25e-1", "-2.50"}, {"1e400", "10e399", "1.0e400"}, {"120", "1.2e2", "12E1"}} {
		for _, n := range same[1:] {
			if of(n) != of(same[0]) {
				t.Errorf("%s and %s fingerprint differently", same[0], n)
			}
		}
	}
	for _, pair := range [][2]string{{"1", "2"}, {"12345678901234567891", "12345678901234567892"}, {"0.1", "0.11"}, {"1e400", "1e401"},
		{"1", "-1"}, {"1", `"1"`}, {"0.000000000000000000001", "0.000000000000000000002"}} {
		if of(pair[0]) == of(pair[1]) {
			t.Errorf("%s and %s fingerprint the same", pair[0], pair[1])
		}
	}
	// As earlier versions stored it: path, then the value as written.
	if of("4200") != idem.Fingerprint([]byte("n"), []byte("4200")) || fp(r, []byte(`{"n":{"b":1.5,"a":[2]}}`)) != idem.Fingerprint([]byte("n"), []byte(`{"a":[2],"b":1.5}`)) {
		t.Error("a fingerprint of numbers already in plain form changed")
	}
}

// TestJSONFingerprintUpgrade: a key an earlier version completed, with the
// fingerprint of its numbers as written ("10.50"), is replayed to the
// retry of the same payload (not answered 422: the event was processed),
// and a different payload is still a mismatch.
func TestJSONFingerprintUpgrade(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	runs := 0
	srv, pool := setup(t, idemhttp.Config{Source: "shop", Key: idemhttp.JSONKey("", "id"), Fingerprint: idemhttp.JSONFingerprint("amount")},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs++; w.Write([]byte("paid\n")) }))
	c := testdb.Client(t, pool, nil)
	old := idem.Fingerprint([]byte("amount"), []byte("10.50")) // as an earlier version stored it
	key := idem.ScopeKey("anonymous", "ord_1")                 // the IETF mode scopes keys per client
	cl, err := c.Claim(ctx, "shop", key, idem.WithFingerprint(old))
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Complete(ctx, "shop", key, cl.Token, json.RawMessage(`{"status":200,"body":"cGFpZAo="}`)); err != nil {
		t.Fatal(err)
	}
	if res := send(t, srv, "POST", "/", `{"id":"ord_1","amount":10.50}`, nil); res.status == 422 || runs != 0 {
		t.Fatalf("the retry of an event processed before the upgrade: %d, runs %d", res.status, runs)
	}
	requireProblem(t, send(t, srv, "POST", "/", `{"id":"ord_1","amount":11}`, nil), 422)
}
