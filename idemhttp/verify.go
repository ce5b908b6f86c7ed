package idemhttp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"

	standardwebhooks "github.com/standard-webhooks/standard-webhooks/libraries/go"
	"github.com/stripe/stripe-go/v85/webhook"
)

// Verifier checks that a delivery really comes from its sender, before
// anything is claimed or stored. It returns nil for a genuine delivery, an
// error matching ErrSignatureMissing for a delivery without (or with a
// malformed) signature, and any other error for a signature that does not
// match, or a timestamp outside the tolerance.
type Verifier func(r *http.Request, body []byte) error

// Verification errors. A delivery that fails verification is answered 400
// (missing or malformed signature) or 401 (wrong signature, a timestamp
// outside the tolerance) as problem+json; nothing is claimed or stored.
var (
	ErrSignatureMissing = errors.New("idemhttp: the delivery carries no valid signature header")
	ErrSignatureInvalid = errors.New("idemhttp: the delivery's signature does not verify")
	// ErrInvalidSecret: a verifier or preset was given no signing secret,
	// an empty one (an unset environment variable), or one that is not in
	// the sender's form. Every way to build a verifier returns it at
	// construction, for any secret of a rotation list.
	ErrInvalidSecret = errors.New("idemhttp: invalid signing secret")
)

// DefaultTolerance is how far a signed timestamp may be from the
// receiver's clock, in the past or in the future: Stripe's and Standard
// Webhooks' own default, 5 minutes.
const DefaultTolerance = 5 * time.Minute

// checkSecrets refuses a list without secrets, and any secret that is
// empty, blank or holds a control character (a newline from an
// environment file): the sender never issues one, and an HMAC under an
// empty key is one anybody can compute.
func checkSecrets(sender string, secrets []string) error {
	if len(secrets) == 0 {
		return fmt.Errorf("%w: %s: no signing secret given", ErrInvalidSecret, sender)
	}
	for i, s := range secrets {
		switch {
		case strings.TrimSpace(s) == "":
			return fmt.Errorf("%w: %s: signing secret %d of %d is empty (an unset environment variable?)", ErrInvalidSecret, sender, i+1, len(secrets))
		case strings.ContainsFunc(s, unicode.IsControl):
			return fmt.Errorf("%w: %s: signing secret %d of %d holds a control character (a trailing newline?)", ErrInvalidSecret, sender, i+1, len(secrets))
		}
	}
	return nil
}

// stripeSecretPrefix starts every Stripe endpoint secret.
const stripeSecretPrefix = "whsec_"

// StripeVerifier verifies the Stripe-Signature header with stripe-go's
// webhook package (every v1 signature in the header: Stripe signs with
// both secrets while one is rolled) and checks its timestamp in both
// directions: more than tolerance before or after the receiver's clock is
// refused (stripe-go checks only age). Several secrets may be given (an
// endpoint's secret while it is being replaced); any one that verifies is
// enough. Every secret must be a Stripe endpoint secret ("whsec_..."),
// or the error matches ErrInvalidSecret; tolerance must be positive.
func StripeVerifier(tolerance time.Duration, secrets ...string) (Verifier, error) {
	if err := checkSecrets("Stripe", secrets); err != nil {
		return nil, err
	}
	for i, s := range secrets {
		if !strings.HasPrefix(s, stripeSecretPrefix) || len(s) == len(stripeSecretPrefix) {
			return nil, fmt.Errorf("%w: Stripe: signing secret %d of %d is not an endpoint secret (whsec_...)", ErrInvalidSecret, i+1, len(secrets))
		}
	}
	if tolerance <= 0 {
		return nil, fmt.Errorf("idemhttp: Stripe: tolerance %v must be positive (DefaultTolerance: %v)", tolerance, DefaultTolerance)
	}
	secrets = append([]string(nil), secrets...)
	return func(r *http.Request, body []byte) error {
		header, err := oneHeader(r, "Stripe", "Stripe-Signature")
		if err != nil {
			return err
		}
		var last error
		for _, s := range secrets {
			last = webhook.ValidatePayloadWithTolerance(body, header, s, tolerance)
			if last == nil {
				break
			}
		}
		switch {
		case errors.Is(last, webhook.ErrInvalidHeader) || errors.Is(last, webhook.ErrNotSigned):
			return fmt.Errorf("%w: Stripe-Signature: %v", ErrSignatureMissing, last)
		case last != nil:
			return fmt.Errorf("%w: Stripe-Signature: %v", ErrSignatureInvalid, last)
		}
		if at := stripeTimestamp(header); at.After(time.Now().Add(tolerance)) {
			return fmt.Errorf("%w: Stripe-Signature: timestamp %d is more than %v in the future", ErrSignatureInvalid, at.Unix(), tolerance)
		}
		return nil
	}, nil
}

// stripeTimestamp reads the header's signed timestamp the way stripe-go
// does (the last t= pair), so the timestamp checked is the one signed.
func stripeTimestamp(header string) time.Time {
	var at time.Time
	for _, pair := range strings.Split(header, ",") {
		if k, v, ok := strings.Cut(pair, "="); ok && k == "t" {
			if n, err := strconv.ParseInt(v, 10, 64); err == nil {
				at = time.Unix(n, 0)
			}
		}
	}
	return at
}

// standardScheme names the id, timestamp and signature headers a
// Standard Webhooks delivery is verified by: webhook-* when
// webhook-signature is present, else Svix's svix-*. The verifier and the
// preset's key both use it, so the key is always the id the signature
// covers.
func standardScheme(h http.Header) (id, timestamp, signature string) {
	if h.Get(standardwebhooks.HeaderWebhookSignature) == "" && h.Get("svix-signature") != "" {
		return "svix-id", "svix-timestamp", "svix-signature"
	}
	return standardwebhooks.HeaderWebhookID, standardwebhooks.HeaderWebhookTimestamp, standardwebhooks.HeaderWebhookSignature
}

// StandardWebhooksVerifier verifies Standard Webhooks signatures
// (webhook-id, webhook-timestamp, webhook-signature) with the
// standard-webhooks Go library, and Svix's (svix-id, svix-timestamp,
// svix-signature: the same scheme under Svix's header names), used only
// when webhook-signature is absent. The signature covers the message id,
// the timestamp and the body; the library refuses a timestamp more than 5
// minutes from the receiver's clock in either direction. A delivery that
// repeats one of these headers is refused as malformed. Secrets are in the
// "whsec_<base64>" form the senders show; an empty, blank or undecodable
// one (or a key that decodes to nothing, "whsec_") is refused with an
// error matching ErrInvalidSecret.
func StandardWebhooksVerifier(secrets ...string) (Verifier, error) {
	if err := checkSecrets("Standard Webhooks", secrets); err != nil {
		return nil, err
	}
	hooks := make([]*standardwebhooks.Webhook, 0, len(secrets))
	for i, s := range secrets {
		key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(s, "whsec_"))
		if err == nil && len(key) == 0 {
			err = errors.New("the key is empty")
		}
		if err != nil {
			return nil, fmt.Errorf("%w: Standard Webhooks: signing secret %d of %d is not whsec_<base64>: %v", ErrInvalidSecret, i+1, len(secrets), err)
		}
		wh, err := standardwebhooks.NewWebhookRaw(key)
		if err != nil {
			return nil, fmt.Errorf("%w: Standard Webhooks: signing secret %d of %d: %v", ErrInvalidSecret, i+1, len(secrets), err)
		}
		hooks = append(hooks, wh)
	}
	return func(r *http.Request, body []byte) error {
		id, ts, sig := standardScheme(r.Header)
		for _, name := range []string{id, ts, sig} {
			if len(r.Header.Values(name)) > 1 {
				return fmt.Errorf("%w: %s is repeated", ErrSignatureMissing, name)
			}
		}
		h := http.Header{}
		h.Set(standardwebhooks.HeaderWebhookID, r.Header.Get(id))
		h.Set(standardwebhooks.HeaderWebhookTimestamp, r.Header.Get(ts))
		h.Set(standardwebhooks.HeaderWebhookSignature, r.Header.Get(sig))
		var last error
		for _, wh := range hooks {
			if last = wh.Verify(body, h); last == nil {
				return nil
			}
		}
		if errors.Is(last, standardwebhooks.ErrRequiredHeaders) || errors.Is(last, standardwebhooks.ErrInvalidHeaders) {
			return fmt.Errorf("%w: %v", ErrSignatureMissing, last)
		}
		return fmt.Errorf("%w: %v", ErrSignatureInvalid, last)
	}, nil
}

// GitHubVerifier verifies X-Hub-Signature-256 ("sha256=" and the hex
// HMAC-SHA256 of the body under the webhook's secret). GitHub's scheme is
// one HMAC; the maintained Go implementation lives inside go-github's API
// client, too large a dependency for one function, so it is written here
// with crypto/hmac's constant-time comparison. An empty or blank secret
// is refused (ErrInvalidSecret).
func GitHubVerifier(secrets ...string) (Verifier, error) {
	if err := checkSecrets("GitHub", secrets); err != nil {
		return nil, err
	}
	return hmacVerifier("GitHub", "X-Hub-Signature-256", "sha256=", hex.DecodeString, secrets), nil
}

// ShopifyVerifier verifies X-Shopify-Hmac-Sha256 (the base64 HMAC-SHA256
// of the body under the app's client secret), the way GitHubVerifier does.
func ShopifyVerifier(secrets ...string) (Verifier, error) {
	if err := checkSecrets("Shopify", secrets); err != nil {
		return nil, err
	}
	return hmacVerifier("Shopify", "X-Shopify-Hmac-Sha256", "", base64.StdEncoding.DecodeString, secrets), nil
}

func hmacVerifier(sender, header, prefix string, decode func(string) ([]byte, error), secrets []string) Verifier {
	secrets = append([]string(nil), secrets...)
	return func(r *http.Request, body []byte) error {
		v, err := oneHeader(r, sender, header)
		if err != nil {
			return err
		}
		sig, err := decode(strings.TrimPrefix(v, prefix))
		if err != nil || !strings.HasPrefix(v, prefix) || len(sig) != sha256.Size {
			return fmt.Errorf("%w: %s is malformed", ErrSignatureMissing, header)
		}
		for _, s := range secrets {
			m := hmac.New(sha256.New, []byte(s))
			m.Write(body)
			if hmac.Equal(m.Sum(nil), sig) {
				return nil
			}
		}
		return fmt.Errorf("%w: %s does not match", ErrSignatureInvalid, header)
	}
}
