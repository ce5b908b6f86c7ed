package idem

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"
)

// Keys. A provider's event id (Stripe's evt_..., GitHub's X-GitHub-Delivery,
// Standard Webhooks' webhook-id) is the best key there is: use it as is.
// Without one, derive the key from the fields that identify the operation,
// never from anything random or from the time of arrival.

// HashKey returns a deterministic key for the given identifying fields: the
// hex SHA-256 of their canonical JSON (object keys sorted at every depth,
// numbers kept exactly as written, no insignificant space). The same fields
// give the same key whatever their order; the key is 64 bytes long.
func HashKey(fields map[string]any) (string, error) {
	canon, err := Canonical(fields)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(canon)
	return hex.EncodeToString(sum[:]), nil
}

// BucketedKey is HashKey with a time bucket: the same fields within the same
// window (aligned to the Unix epoch) give the same key, the next window a
// new one. It guards form double-submits: two taps within the window are
// one operation, a deliberate repeat later is a new one.
func BucketedKey(fields map[string]any, at time.Time, window time.Duration) (string, error) {
	if window <= 0 {
		return "", fmt.Errorf("%w: bucket window must be positive, got %s", ErrInvalidInput, window)
	}
	if _, clash := fields["_idem_bucket"]; clash {
		return "", fmt.Errorf("%w: field name _idem_bucket is reserved", ErrInvalidInput)
	}
	with := make(map[string]any, len(fields)+1)
	for k, v := range fields {
		with[k] = v
	}
	with["_idem_bucket"] = strconv.FormatInt(at.UnixNano()/int64(window), 10) + "/" + window.String()
	return HashKey(with)
}

// Fingerprint returns the hex SHA-256 of the parts, each length-prefixed so
// that ("ab","c") and ("a","bc") differ. Use it for WithFingerprint, for
// example Fingerprint(method, path, body).
func Fingerprint(parts ...[]byte) string {
	h := sha256.New()
	for _, p := range parts {
		fmt.Fprintf(h, "%d:", len(p))
		h.Write(p)
	}
	return hex.EncodeToString(h.Sum(nil))
}

// Canonical returns the canonical JSON of v: v is marshalled, decoded with
// numbers kept as written, and marshalled again, which sorts object keys.
func Canonical(v any) ([]byte, error) {
	if v == nil {
		return nil, fmt.Errorf("%w: no fields to derive a key from", ErrInvalidInput)
	}
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%w: fields are not JSON-encodable: %w", ErrInvalidInput, err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var generic any
	if err := dec.Decode(&generic); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidInput, err)
	}
	if m, ok := generic.(map[string]any); generic == nil || ok && len(m) == 0 {
		return nil, fmt.Errorf("%w: no fields to derive a key from", ErrInvalidInput)
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(generic); err != nil {
		return nil, errors.Join(ErrInvalidInput, err)
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}

// JoinKey builds a key from several parts so that no other list of parts
// gives the same key: each part is escaped (a backslash becomes `\\`, a
// colon `\:`) and the parts are joined with ":". Parts that hold neither a
// colon nor a backslash are kept as they are, so JoinKey("orders", "42")
// is "orders:42", as a plain join gives; ("a:b", "c") is `a\:b:c` and
// ("a", "b:c") is `a:b\:c`. It is the one encoding of idem's composite
// keys (idemhttp.JSONKey and idemhttp.Compose with several parts, the
// cache's (source, key)); docs/reliability.md lists every composite key
// idem builds and why each is unambiguous.
func JoinKey(first string, rest ...string) string {
	n := len(first)
	for _, p := range rest {
		n += 1 + len(p)
	}
	b := make([]byte, 0, n+4)
	b = appendKeyPart(b, first, ':')
	for _, p := range rest {
		b = appendKeyPart(append(b, ':'), p, ':')
	}
	return string(b)
}

// appendKeyPart appends part escaped for a join with sep: sep and the
// backslash are preceded by a backslash, so the first unescaped sep ends
// the part.
func appendKeyPart(b []byte, part string, sep byte) []byte {
	for i := 0; i < len(part); i++ {
		if ch := part[i]; ch == '\\' || ch == sep {
			b = append(b, '\\')
		}
		b = append(b, part[i])
	}
	return b
}

// ScopeKey prefixes key with the scope it belongs to (idemhttp's
// Config.Scope), joined with "|": a scope that holds neither "|" nor a
// backslash (any user or tenant id without them) is kept as
// it is, as before; one that does is escaped (JoinKey's rule with "|" as
// the separator), so the first unescaped "|" always ends the scope and
// two (scope, key) pairs never give one key. The key itself is not
// escaped: it is the rest of the string. The empty scope (no principal)
// is a scope like the others: ScopeKey("", "a|b") is "|a|b", and no
// other scope's key starts with an unescaped "|", so keys without a
// principal never meet a principal's, whatever bytes they hold.
func ScopeKey(scope, key string) string {
	b := appendKeyPart(make([]byte, 0, len(scope)+len(key)+3), scope, '|')
	return string(append(append(b, '|'), key...))
}
