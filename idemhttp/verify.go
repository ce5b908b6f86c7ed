package idemhttp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

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
// (missing or malformed signature) or 401 (wrong signature, stale
// timestamp) as problem+json; nothing is claimed or stored.
var (
	ErrSignatureMissing = errors.New("idemhttp: the delivery carries no valid signature header")
	ErrSignatureInvalid = errors.New("idemhttp: the delivery's signature does not verify")
)

// DefaultTolerance is how old (or how far in the future) a signed
// timestamp may be: Stripe's and Standard Webhooks' own default, 5 minutes.
const DefaultTolerance = 5 * time.Minute

// StripeVerifier verifies the Stripe-Signature header with stripe-go's
// webhook package: its timestamp tolerance and every v1 signature in the
// header (Stripe signs with both secrets while one is rolled). Several
// secrets may be given (an endpoint's secret while it is being replaced);
// any one that verifies is enough.
func StripeVerifier(tolerance time.Duration, secrets ...string) Verifier {
	return func(r *http.Request, body []byte) error {
		header := r.Header.Get("Stripe-Signature")
		if header == "" {
			return fmt.Errorf("%w: Stripe-Signature is missing", ErrSignatureMissing)
		}
		last := errors.New("no signing secret is configured")
		for _, s := range secrets {
			last = webhook.ValidatePayloadWithTolerance(body, header, s, tolerance)
			if last == nil {
				return nil
			}
		}
		if errors.Is(last, webhook.ErrInvalidHeader) || errors.Is(last, webhook.ErrNotSigned) {
			return fmt.Errorf("%w: Stripe-Signature: %v", ErrSignatureMissing, last)
		}
		return fmt.Errorf("%w: Stripe-Signature: %v", ErrSignatureInvalid, last)
	}
}

// StandardWebhooksVerifier verifies Standard Webhooks signatures
// (webhook-id, webhook-timestamp, webhook-signature) with the
// standard-webhooks Go library, and Svix's (svix-id, svix-timestamp,
// svix-signature: the same scheme under Svix's header names). Secrets are
// in the "whsec_<base64>" form the senders show. The library enforces its
// own 5-minute tolerance.
func StandardWebhooksVerifier(secrets ...string) (Verifier, error) {
	hooks := make([]*standardwebhooks.Webhook, 0, len(secrets))
	for i, s := range secrets {
		wh, err := standardwebhooks.NewWebhook(s)
		if err != nil {
			return nil, fmt.Errorf("idemhttp: Standard Webhooks secret %d is not whsec_<base64>: %w", i+1, err)
		}
		hooks = append(hooks, wh)
	}
	return func(r *http.Request, body []byte) error {
		h := r.Header
		if h.Get(standardwebhooks.HeaderWebhookSignature) == "" && h.Get("svix-signature") != "" {
			h = http.Header{}
			h.Set(standardwebhooks.HeaderWebhookID, r.Header.Get("svix-id"))
			h.Set(standardwebhooks.HeaderWebhookTimestamp, r.Header.Get("svix-timestamp"))
			h.Set(standardwebhooks.HeaderWebhookSignature, r.Header.Get("svix-signature"))
		}
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
// with crypto/hmac's constant-time comparison.
func GitHubVerifier(secrets ...string) Verifier {
	return hmacVerifier("X-Hub-Signature-256", "sha256=", hex.DecodeString, secrets)
}

// ShopifyVerifier verifies X-Shopify-Hmac-Sha256 (the base64 HMAC-SHA256
// of the body under the app's client secret), the way GitHubVerifier does.
func ShopifyVerifier(secrets ...string) Verifier {
	return hmacVerifier("X-Shopify-Hmac-Sha256", "", base64.StdEncoding.DecodeString, secrets)
}

func hmacVerifier(header, prefix string, decode func(string) ([]byte, error), secrets []string) Verifier {
	return func(r *http.Request, body []byte) error {
		v := strings.TrimSpace(r.Header.Get(header))
		if v == "" {
			return fmt.Errorf("%w: %s is missing", ErrSignatureMissing, header)
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
