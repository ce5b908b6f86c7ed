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
