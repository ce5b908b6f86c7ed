package idemhttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"

	"github.com/tidwall/gjson"

	"github.com/idemkit/idem"
)

// ErrKeyField: the body has no usable value at a key's JSON path (missing,
// null, an object, an array, a boolean, a fraction, empty), or is not
// JSON. The middleware answers 400 and claims nothing: a key is never
// made of an empty or absent field. Errors are *KeyFieldError.
var ErrKeyField = errors.New("idemhttp: no usable key field")

// KeyFieldError names the path and what was found there.
type KeyFieldError struct {
	Path    string // "" for the body as a whole
	Problem string
}

func (e *KeyFieldError) Error() string {
	if e.Path == "" {
		return "idemhttp: key from the JSON body: " + e.Problem
	}
	return fmt.Sprintf("idemhttp: key field %q: %s", e.Path, e.Problem)
}

// Is matches ErrKeyField.
func (e *KeyFieldError) Is(target error) bool { return target == ErrKeyField }

// maxKey is idem's limit on a key, in bytes.
const maxKey = 512

// JSONKey keys by the values at paths in the JSON body, in gjson's path
// syntax ("data.object.id", "items.0.sku"; see github.com/tidwall/gjson).
// One path: the key is the value as it is. Several: the values are joined
// in the order given by idem.JoinKey (":" between them, a ":" or "\" inside
// a value escaped with "\"), so that two events whose fields differ never
// share a key ("a:b","c" and "a","b:c" are `a\:b:c` and `a:b\:c`); values
// without ":" or "\" give the same key as a plain join. Every path
// is required, and must hold a non-empty string or an integer; anything
// else is an ErrKeyField error naming the path (answered 400, nothing
// claimed), never an empty or partial key. typePath, when not "", is the
// event type's field (optional: absent gives no type).
//
//	idemhttp.Config{Client: c, Source: "orders", Key: idemhttp.JSONKey("type", "data.object.id")}
func JSONKey(typePath string, paths ...string) KeyFunc {
	return func(_ *http.Request, body []byte) (string, string, error) {
		if len(paths) == 0 {
			return "", "", &KeyFieldError{Problem: "JSONKey was given no path"}
		}
		if !gjson.ValidBytes(body) {
			return "", "", &KeyFieldError{Problem: "the body is not JSON"}
		}
		parts := make([]string, len(paths))
		for i, p := range paths {
			v, err := keyValue(body, p)
			if err != nil {
				return "", "", err
			}
			parts[i] = v
		}
		key := joinParts(parts)
		if len(key) > maxKey {
			return "", "", &KeyFieldError{Path: strings.Join(paths, ","), Problem: fmt.Sprintf("the key would be %d bytes, over idem's %d", len(key), maxKey)}
		}
		typ := ""
		if typePath != "" {
			if t := gjson.GetBytes(body, typePath); t.Type == gjson.String {
				typ = t.Str
			}
		}
		return key, typ, nil
	}
}

// keyValue is the key part at path: a non-empty string, or an integer in
// its JSON form.
func keyValue(body []byte, path string) (string, error) {
	v := gjson.GetBytes(body, path)
	problem := ""
	switch {
	case !v.Exists():
		problem = "not in the body"
	case v.Type == gjson.String && strings.TrimSpace(v.Str) == "":
		problem = "an empty string"
	case v.Type == gjson.String:
		return v.Str, nil
	case v.Type == gjson.Number && isInteger(v.Raw):
		return v.Raw, nil
	case v.Type == gjson.Number:
		problem = "a number with a fraction or exponent (" + idem.Quote(v.Raw) + "); keys are strings or integers"
	case v.Type == gjson.Null:
		problem = "null"
	case v.IsArray():
		problem = "an array"
	case v.IsObject():
		problem = "an object"
	default:
		problem = "a boolean"
	}
	return "", &KeyFieldError{Path: path, Problem: problem}
}

func isInteger(raw string) bool {
	raw = strings.TrimPrefix(raw, "-")
	if raw == "" {
		return false
	}
	for i := 0; i < len(raw); i++ {
		if raw[i] < '0' || raw[i] > '9' {
			return false
		}
	}
	return true
}

// Compose keys by several KeyFuncs at once (headers and JSON fields, say),
// their keys joined in order by idem.JoinKey as JSONKey joins its values
// (one KeyFunc: its key as it is); each must give a key (an empty one
// is an ErrKeyField error naming its position), and the event type is the
// first one given.
//
//	Key: idemhttp.Compose(idemhttp.HeaderKey("", "X-Shopify-Shop-Domain"), idemhttp.JSONKey("", "id"))
func Compose(keys ...KeyFunc) KeyFunc {
	return func(r *http.Request, body []byte) (string, string, error) {
		parts := make([]string, len(keys))
		typ := ""
		for i, k := range keys {
			key, t, err := k(r, body)
			if err != nil {
				return "", "", err
			}
			if key == "" {
				return "", "", &KeyFieldError{Problem: fmt.Sprintf("part %d of %d of the composed key is missing", i+1, len(keys))}
			}
			parts[i] = key
			if typ == "" {
				typ = t
			}
		}
		key := joinParts(parts)
		if len(key) > maxKey {
			return "", "", &KeyFieldError{Problem: fmt.Sprintf("the composed key would be %d bytes, over idem's %d", len(key), maxKey)}
		}
		return key, typ, nil
	}
}

// joinParts is the key of parts: one part as it is, several by
// idem.JoinKey.
func joinParts(parts []string) string {
	if len(parts) == 1 {
		return parts[0]
	}
	return idem.JoinKey(parts[0], parts[1:]...)
}

// JSONFingerprint fingerprints the values at paths of the JSON body only
// (gjson paths), so that a sender adding or reordering other fields on a
// retry is not a mismatch. Each value is compared in a canonical form
// (object keys sorted, insignificant white space dropped, numbers by their
// value: 1, 1.0, 1e0 and 10E-1 are one number, written as the shortest
// plain decimal, so a sender or proxy that re-serializes numbers is not a
// mismatch; numbers already written that way fingerprint as before, and on
// a mismatch the middleware tries the form earlier versions stored); an
// absent path counts as absent, not as an error. A body that is not JSON
// is fingerprinted whole.
func JSONFingerprint(paths ...string) FingerprintFunc {
	return func(r *http.Request, body []byte) string {
		canonical := canonicalValue
		if r != nil && r.Context().Value(legacyFingerprintKey{}) != nil {
			canonical = asWritten // the fingerprint earlier versions stored
		}
		if !gjson.ValidBytes(body) {
			return idem.Fingerprint(body)
		}
		parts := make([][]byte, 0, 2*len(paths))
		for _, p := range paths {
			parts = append(parts, []byte(p))
			v := gjson.GetBytes(body, p)
			if !v.Exists() {
				parts = append(parts, []byte{0})
				continue
			}
			c, err := canonical(v.Raw)
			if err != nil {
				c = []byte(v.Raw)
			}
			parts = append(parts, c)
		}
		return idem.Fingerprint(parts...)
	}
}

// legacyFingerprintKey, in a request's context, asks JSONFingerprint for
// the fingerprint versions before numbers were compared by value stored
// (numbers as written), and RequestFingerprint for the one without the
// query string: the middleware claims with it once more when the
// first claim answers Mismatch and it differs, so that a retry of an event
// accepted before the upgrade still matches its stored fingerprint.
type legacyFingerprintKey struct{}

// legacyFingerprint is fp's form in earlier versions (JSONFingerprint's
// before numbers were compared by value, RequestFingerprint's before the
// query string was covered), or "" when it is the same (other
// FingerprintFuncs, numbers already in their shortest form, no query).
func legacyFingerprint(f FingerprintFunc, r *http.Request, body []byte, fp string) string {
	old := f(r.WithContext(context.WithValue(r.Context(), legacyFingerprintKey{}, true)), body)
	if old == fp {
		return ""
	}
	return old
}

// asWritten is idem.Canonical of a JSON value, numbers as written.
func asWritten(raw string) ([]byte, error) { return idem.Canonical(json.RawMessage(raw)) }

// canonicalValue is idem.Canonical of a JSON value with every number
// written by canonicalNumber.
func canonicalValue(raw string) ([]byte, error) {
	dec := json.NewDecoder(strings.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	return idem.Canonical(normalizeNumbers(v))
}

func normalizeNumbers(v any) any {
	switch x := v.(type) {
	case json.Number:
		return json.Number(canonicalNumber(string(x)))
	case map[string]any:
		for k, e := range x {
			x[k] = normalizeNumbers(e)
		}
	case []any:
		for i, e := range x {
			x[i] = normalizeNumbers(e)
		}
	}
	return v
}

// canonicalNumber writes a JSON number by its exact value: the shortest
// plain decimal ("1.0" and "1e0" are "1", "1.50" is "1.5", "-0" is "0"),
// or digits and an exponent ("1e400") when the plain form would be longer
// than maxPlain. Exact: no float conversion, so large integers stay
// distinct.
func canonicalNumber(n string) string {
	const maxPlain = 100
	orig := n
	neg := strings.HasPrefix(n, "-")
	n = strings.TrimPrefix(n, "-")
	mant, exp := n, int64(0)
	if i := strings.IndexAny(n, "eE"); i >= 0 {
		e, err := strconv.ParseInt(strings.TrimPrefix(n[i+1:], "+"), 10, 32)
		if err != nil {
			return orig // an exponent past 32 bits: as written
		}
		mant, exp = n[:i], e
	}
	digits := mant
	if i := strings.IndexByte(mant, '.'); i >= 0 {
		digits = mant[:i] + mant[i+1:]
		exp -= int64(len(mant) - i - 1)
	}
	digits = strings.TrimLeft(digits, "0")
	if digits == "" {
		return "0"
	}
	trimmed := strings.TrimRight(digits, "0")
	exp += int64(len(digits) - len(trimmed))
	digits = trimmed
	sign := ""
	if neg {
		sign = "-"
	}
	// value = digits × 10^exp
	switch {
	case exp >= 0 && int64(len(digits))+exp <= maxPlain:
		return sign + digits + strings.Repeat("0", int(exp))
	case exp < 0 && -exp < int64(len(digits)):
		point := int64(len(digits)) + exp
		return sign + digits[:point] + "." + digits[point:]
	case exp < 0 && -exp-int64(len(digits)) < maxPlain:
		return sign + "0." + strings.Repeat("0", int(-exp-int64(len(digits)))) + digits
	}
	return sign + digits + "e" + strconv.FormatInt(exp, 10)
}
