package idemhttp

import (
	"crypto/hmac"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// The building blocks of the sender presets' signature schemes. Each
// scheme is a few lines over these; every one is exercised against its
// sender's published example or official library (docs/senders.md).

// macOf is the HMAC of the concatenated parts under secret.
func macOf(h func() hash.Hash, secret string, parts ...[]byte) []byte {
	m := hmac.New(h, []byte(secret))
	for _, p := range parts {
		m.Write(p)
	}
	return m.Sum(nil)
}

// anySecret reports whether the MAC of the parts under one of the secrets
// equals sig (constant-time per secret).
func anySecret(h func() hash.Hash, secrets []string, sig []byte, parts ...[]byte) bool {
	for _, s := range secrets {
		if hmac.Equal(macOf(h, s, parts...), sig) {
			return true
		}
	}
	return false
}

// oneHeader returns the single value of a signature header: absent is
// ErrSignatureMissing, and so is a repeated one (which value was signed is
// not ours to guess).
func oneHeader(r *http.Request, sender, name string) (string, error) {
	vs := r.Header.Values(name)
	switch {
	case len(vs) == 0 || strings.TrimSpace(vs[0]) == "":
		return "", fmt.Errorf("%w: %s: %s is missing", ErrSignatureMissing, sender, name)
	case len(vs) > 1:
		return "", fmt.Errorf("%w: %s: %s is repeated", ErrSignatureMissing, sender, name)
	}
	return strings.TrimSpace(vs[0]), nil
}

// decodeSig decodes a signature value with its prefix (e.g. "v0=",
// "sha256=") into a digest of size bytes; anything else is malformed.
func decodeSig(sender, header, v, prefix string, decode func(string) ([]byte, error), size int) ([]byte, error) {
	rest, ok := strings.CutPrefix(v, prefix)
	if !ok {
		return nil, fmt.Errorf("%w: %s: %s does not start with %q", ErrSignatureMissing, sender, header, prefix)
	}
	sig, err := decode(rest)
	if err != nil || len(sig) != size {
		return nil, fmt.Errorf("%w: %s: %s is malformed", ErrSignatureMissing, sender, header)
	}
	return sig, nil
}

var (
	hexDecode = hex.DecodeString
	b64Decode = base64.StdEncoding.DecodeString
)

// checkStamp refuses a signed timestamp more than tolerance away from the
// receiver's clock, in either direction (docs/senders.md, "Timestamps").
func checkStamp(sender string, at time.Time, tolerance time.Duration) error {
	if d := time.Since(at); d > tolerance || d < -tolerance {
		return fmt.Errorf("%w: %s: the signed timestamp %s is more than %v from the receiver's clock", ErrSignatureInvalid, sender, at.UTC().Format(time.RFC3339), tolerance)
	}
	return nil
}

// unixStamp parses a decimal Unix timestamp in seconds (or, with ms, in
// milliseconds) from a signature header.
func unixStamp(sender, header, v string, ms bool) (time.Time, error) {
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return time.Time{}, fmt.Errorf("%w: %s: %s is not a Unix timestamp", ErrSignatureMissing, sender, header)
	}
	if ms {
		return time.UnixMilli(n), nil
	}
	return time.Unix(n, 0), nil
}

// hmacBodyVerifier verifies a header holding prefix and the encoded HMAC
// of the body alone (GitHub's shape, for the senders that copied it).
func hmacBodyVerifier(sender, header, prefix string, h func() hash.Hash, decode func(string) ([]byte, error)) func(secrets ...string) (Verifier, error) {
	return func(secrets ...string) (Verifier, error) {
		if err := checkSecrets(sender, secrets); err != nil {
			return nil, err
		}
		secrets = append([]string(nil), secrets...)
		size := h().Size()
		return func(r *http.Request, body []byte) error {
			v, err := oneHeader(r, sender, header)
			if err != nil {
				return err
			}
			sig, err := decodeSig(sender, header, v, prefix, decode, size)
			if err != nil {
				return err
			}
			if !anySecret(h, secrets, sig, body) {
				return fmt.Errorf("%w: %s: %s does not match", ErrSignatureInvalid, sender, header)
			}
			return nil
		}, nil
	}
}

var (
	sha256New = sha256.New
	sha1New   = sha1.New
)

// jsonFields reads a JSON object body's fields by path ("event.id");
// strings are returned as they are, numbers as written. A missing field
// is "". The body must be a JSON object.
func jsonFields(body []byte, paths ...string) ([]string, error) {
	var root map[string]json.RawMessage
	if err := json.Unmarshal(body, &root); err != nil {
		return nil, fmt.Errorf("the body is not a JSON object: %w", err)
	}
	out := make([]string, len(paths))
	for i, p := range paths {
		out[i] = jsonField(root, p)
	}
	return out, nil
}

func jsonField(obj map[string]json.RawMessage, path string) string {
	head, rest, nested := strings.Cut(path, ".")
	raw, ok := obj[head]
	if !ok {
		return ""
	}
	if nested {
		var inner map[string]json.RawMessage
		if json.Unmarshal(raw, &inner) != nil {
			return ""
		}
		return jsonField(inner, rest)
	}
	return scalar(raw)
}

// scalar is a JSON string's value, or a number or boolean as written;
// "" for anything else.
func scalar(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	t := strings.TrimSpace(string(raw))
	if t == "null" || t == "" || t[0] == '{' || t[0] == '[' {
		return ""
	}
	return t
}

// bodyKey keys by fields of the signed JSON body: idPath is the event id,
// typePath the event type.
func bodyKey(idPath, typePath string) KeyFunc {
	return func(_ *http.Request, body []byte) (string, string, error) {
		if len(body) == 0 {
			return "", "", nil
		}
		f, err := jsonFields(body, idPath, typePath)
		if err != nil {
			return "", "", err
		}
		return f[0], f[1], nil
	}
}

// bodyDigestKey keys by the SHA-256 of the signed body, for senders whose
// events carry no id (Zoom): a retry carries the same bytes, and two
// events never do (each holds its own timestamp). The type is typePath.
func bodyDigestKey(typePath string) KeyFunc {
	return func(_ *http.Request, body []byte) (string, string, error) {
		if len(body) == 0 {
			return "", "", nil
		}
		f, err := jsonFields(body, typePath)
		if err != nil {
			return "", "", err
		}
		d := sha256.Sum256(body)
		return "sha256:" + hex.EncodeToString(d[:]), f[0], nil
	}
}
