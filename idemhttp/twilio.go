package idemhttp

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"mime"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// TwilioRetention is how long the Twilio preset keeps keys. Twilio retries
// a webhook only as its connection overrides say (#rc=, at most 5
// retries, within seconds: twilio.com/docs/usage/webhooks/webhooks-connection-overrides)
// and re-sends by hand from the console's error logs; a week covers both.
const TwilioRetention = 7 * 24 * time.Hour

// TwilioVerifier verifies X-Twilio-Signature, the base64 HMAC-SHA1 under
// the account's auth token of the full public URL Twilio called
// (PublicURL) followed, for a form-encoded body, by every parameter's name
// and value, sorted by name. A JSON body (Event Streams, some callbacks)
// is signed through the URL: its bodySHA256 query parameter must be the
// hex SHA-256 of the body, and the signature covers the URL alone. As
// Twilio's own validators do, the URL is tried with and without the
// scheme's default port. A signature that matches another URL the request
// could stand for is refused with a *URLMismatchError naming both.
func TwilioVerifier(u PublicURL, authTokens ...string) (Verifier, error) {
	if err := checkSecrets("Twilio", authTokens); err != nil {
		return nil, err
	}
	if err := u.check("Twilio"); err != nil {
		return nil, err
	}
	tokens := append([]string(nil), authTokens...)
	return func(r *http.Request, body []byte) error {
		v, err := oneHeader(r, "Twilio", "X-Twilio-Signature")
		if err != nil {
			return err
		}
		sig, err := decodeSig("Twilio", "X-Twilio-Signature", v, "", b64Decode, sha1New().Size())
		if err != nil {
			return err
		}
		var params []byte
		if want := r.URL.Query().Get("bodySHA256"); want != "" {
			got := sha256.Sum256(body)
			if subtle.ConstantTimeCompare([]byte(hex.EncodeToString(got[:])), []byte(strings.ToLower(want))) != 1 {
				return fmt.Errorf("%w: Twilio: the body's SHA-256 is not the URL's bodySHA256", ErrSignatureInvalid)
			}
		} else if isForm(r) {
			form, err := url.ParseQuery(string(body))
			if err != nil {
				return fmt.Errorf("%w: Twilio: the form body does not parse: %v", ErrSignatureMissing, err)
			}
			params = twilioParams(form)
		}
		return urlVerify("Twilio", u, r, true, func(full string) bool {
			return anySecret(sha1New, tokens, sig, []byte(full), params)
		})
	}, nil
}

// twilioParams is the signed form of the parameters: each name followed
// by its value, sorted by name (a repeated name's values sorted too).
func twilioParams(form url.Values) []byte {
	var b strings.Builder
	for _, k := range slices.Sorted(maps.Keys(form)) {
		vs := slices.Clone(form[k])
		slices.Sort(vs)
		for _, v := range vs {
			b.WriteString(k)
			b.WriteString(v)
		}
	}
	return []byte(b.String())
}

func isForm(r *http.Request) bool {
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	return mt == "application/x-www-form-urlencoded"
}

// Twilio verifies X-Twilio-Signature first (TwilioVerifier, over the
// public URL u), and keys by I-Twilio-Idempotency-Token, which Twilio
// sends with every webhook and keeps when it retries, else by the SHA-256
// of the request target and the body (for a GET, the query carries the
// signed parameters). The type is the parameters' MessageStatus,
// SmsStatus or CallStatus (the form body, or a GET's query), or a JSON
// body's "type". The fingerprint is what the signature covers besides the
// URL: the body, or a GET's query parameters (twilioFingerprint).
//
// There is no replay guard: Twilio legitimately sends identical signed
// requests as distinct events (a looping <Gather> or <Redirect> posts the
// same parameters to the same URL for every key press; Twilio's
// signature, HMAC-SHA1 of the URL and the sorted parameters, carries no
// timestamp or nonce), each under its own token. A guard on the signed
// content would answer the caller's second key press as a duplicate; the
// token is what Twilio keeps across retries and changes across events.
// The token is not signed: a captured request re-sent under a fresh token
// runs again, as it would past Twilio's own validators. docs/senders.md.
func Twilio(u PublicURL, authTokens ...string) Preset {
	return preset(senderPreset{source: "twilio", name: "Twilio", key: twilioKey, fingerprint: twilioFingerprint,
		ttl: TwilioRetention, secrets: authTokens,
		verifier: func(s ...string) (Verifier, error) { return TwilioVerifier(u, s...) },
		headers:  []string{"X-Twilio-Signature", "I-Twilio-Idempotency-Token", "X-Home-Region"}})
}

// twilioFields are the parameters whose value is a Twilio delivery's type.
var twilioFields = []string{"MessageStatus", "SmsStatus", "CallStatus", "EventType"}

func twilioKey(r *http.Request, body []byte) (string, string, error) {
	typ := ""
	switch {
	case isForm(r):
		form, err := url.ParseQuery(string(body))
		if err != nil {
			return "", "", fmt.Errorf("the form body does not parse: %w", err)
		}
		typ = twilioType(form)
	case len(body) > 0:
		var ev struct{ Type string }
		_ = json.Unmarshal(body, &ev)
		typ = ev.Type
	default:
		// A GET (the phone number's or callback's "HTTP GET" setting):
		// the parameters are the signed query.
		typ = twilioType(r.URL.Query())
	}
	if k := strings.TrimSpace(r.Header.Get("I-Twilio-Idempotency-Token")); k != "" {
		return k, typ, nil
	}
	d := sha256.Sum256(append([]byte(r.URL.RequestURI()+"\n"), body...))
	return "sha256:" + base64.RawURLEncoding.EncodeToString(d[:]), typ, nil
}

func twilioType(params url.Values) string {
	for _, f := range twilioFields {
		if v := params.Get(f); v != "" {
			return v
		}
	}
	return ""
}

// twilioFingerprint is what Twilio signs besides the URL's scheme, host
// and path: the body (BodyFingerprint, as before: keys stored by an
// earlier version keep matching), or, for a request without one (a GET),
// its query parameters in the signed form (twilioParams). A token
// re-sent with other signed parameters is a mismatch (422), never the
// earlier delivery's answer.
func twilioFingerprint(r *http.Request, body []byte) string {
	if len(body) > 0 {
		return BodyFingerprint(r, body)
	}
	return idem.Fingerprint([]byte("twilio query"), twilioParams(r.URL.Query()))
}
