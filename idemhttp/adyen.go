package idemhttp

import (
	"bytes"
	"crypto/hmac"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// AdyenRetention is how long the Adyen preset keeps each notification's
// key: Adyen retries a notification batch that is not acknowledged with
// "[accepted]" on a falling schedule for up to 30 days
// (docs.adyen.com/development-resources/webhooks/troubleshoot, "Retry
// schedule"); 35 days covers it.
const AdyenRetention = 35 * 24 * time.Hour

// adyenItem is a NotificationRequestItem: the fields its HMAC covers.
type adyenItem struct {
	PspReference        string `json:"pspReference"`
	OriginalReference   string `json:"originalReference"`
	MerchantAccountCode string `json:"merchantAccountCode"`
	MerchantReference   string `json:"merchantReference"`
	Amount              struct {
		Value    json.Number `json:"value"`
		Currency string      `json:"currency"`
	} `json:"amount"`
	EventCode      string            `json:"eventCode"`
	Success        string            `json:"success"`
	AdditionalData map[string]string `json:"additionalData"`
}

// adyenItems splits an Adyen notification into its NotificationRequestItem
// objects, and builds the body of some of them.
func adyenItems(body []byte) ([]json.RawMessage, func([]json.RawMessage) []byte, error) {
	var n struct {
		NotificationItems []struct {
			Item json.RawMessage `json:"NotificationRequestItem"`
		} `json:"notificationItems"`
	}
	if err := json.Unmarshal(body, &n); err != nil {
		return nil, nil, fmt.Errorf("not an Adyen notification: %w", err)
	}
	if len(n.NotificationItems) == 0 {
		return nil, nil, fmt.Errorf("not an Adyen notification: no notificationItems")
	}
	items := make([]json.RawMessage, len(n.NotificationItems))
	for i, it := range n.NotificationItems {
		if len(it.Item) == 0 {
			return nil, nil, fmt.Errorf("notification item %d has no NotificationRequestItem", i+1)
		}
		items[i] = it.Item
	}
	return items, func(fresh []json.RawMessage) []byte {
		signed := make([]json.RawMessage, len(fresh))
		for i, raw := range fresh {
			signed[i] = adyenSignedOnly(raw)
		}
		return joinRaw(`{"notificationItems":[`, signed, `]}`, `{"NotificationRequestItem":`, `}`)
	}, nil
}

// adyenSignedFields are the fields of a NotificationRequestItem its HMAC
// covers, amount (its value and currency) apart.
var adyenSignedFields = []string{"pspReference", "originalReference", "merchantAccountCode", "merchantReference", "eventCode", "success"}

// adyenSignedOnly is a verified NotificationRequestItem with only what its
// HMAC covers: the eight signed fields, each as delivered, and
// additionalData.hmacSignature (so the item still verifies with Adyen's
// own validateHMAC). Everything else (reason, paymentMethod, eventDate,
// operations, the rest of additionalData) is not signed: anyone holding
// one delivery can change it, and after a failed first attempt such a
// copy can win the item's key, so the handler never sees it
// (docs/senders.md, "Adyen: only what is signed").
func adyenSignedOnly(raw json.RawMessage) json.RawMessage {
	var it map[string]json.RawMessage
	if json.Unmarshal(raw, &it) != nil {
		return raw // not reached: the verifier read the same item
	}
	out := map[string]any{}
	for _, k := range adyenSignedFields {
		if v, ok := it[k]; ok {
			out[k] = v
		}
	}
	var amount map[string]json.RawMessage
	if json.Unmarshal(it["amount"], &amount) == nil && amount != nil {
		kept := map[string]json.RawMessage{}
		for _, k := range []string{"value", "currency"} {
			if v, ok := amount[k]; ok {
				kept[k] = v
			}
		}
		out["amount"] = kept
	}
	var extra map[string]json.RawMessage
	if json.Unmarshal(it["additionalData"], &extra) == nil {
		if sig, ok := extra["hmacSignature"]; ok {
			out["additionalData"] = map[string]json.RawMessage{"hmacSignature": sig}
		}
	}
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false) // the values' bytes as delivered
	if enc.Encode(out) != nil {
		return raw
	}
	return bytes.TrimRight(b.Bytes(), "\n")
}

// AdyenVerifier verifies the HMAC signature of every NotificationRequestItem
// of a standard Adyen webhook: additionalData.hmacSignature is the base64
// HMAC-SHA256, under the webhook's HMAC key (hex), of pspReference,
// originalReference, merchantAccountCode, merchantReference, amount value,
// amount currency, eventCode and success, joined by ":". A delivery is
// genuine only if every item verifies (under one of the keys, while a key
// is rotated). Adyen signs no timestamp.
func AdyenVerifier(hmacKeys ...string) (Verifier, error) {
	if err := checkSecrets("Adyen", hmacKeys); err != nil {
		return nil, err
	}
	keys := make([]string, len(hmacKeys))
	for i, k := range hmacKeys {
		raw, err := hex.DecodeString(strings.TrimSpace(k))
		if err != nil || len(raw) == 0 {
			return nil, fmt.Errorf("%w: Adyen: HMAC key %d of %d is not hex", ErrInvalidSecret, i+1, len(hmacKeys))
		}
		keys[i] = string(raw)
	}
	return func(_ *http.Request, body []byte) error {
		items, _, err := adyenItems(body)
		if err != nil {
			return fmt.Errorf("%w: Adyen: %v", ErrSignatureMissing, err)
		}
		for i, raw := range items {
			var it adyenItem
			if err := json.Unmarshal(raw, &it); err != nil {
				return fmt.Errorf("%w: Adyen: item %d: %v", ErrSignatureMissing, i+1, err)
			}
			sig, err := base64.StdEncoding.DecodeString(it.AdditionalData["hmacSignature"])
			if err != nil || len(sig) != 32 {
				return fmt.Errorf("%w: Adyen: item %d has no valid additionalData.hmacSignature", ErrSignatureMissing, i+1)
			}
			data := strings.Join([]string{it.PspReference, it.OriginalReference, it.MerchantAccountCode, it.MerchantReference,
				it.Amount.Value.String(), it.Amount.Currency, it.EventCode, it.Success}, ":")
			ok := false
			for _, k := range keys {
				if hmac.Equal(macOf(sha256New, k, []byte(data)), sig) {
					ok = true
					break
				}
			}
			if !ok {
				return fmt.Errorf("%w: Adyen: the HMAC of item %d (%s %s) does not match", ErrSignatureInvalid, i+1, it.EventCode, it.PspReference)
			}
		}
		return nil
	}, nil
}

// Adyen receives standard webhooks (a notification holding one or more
// NotificationRequestItem objects): it verifies every item's HMAC first
// (AdyenVerifier), then deduplicates each item on its eventCode,
// pspReference and success, as Adyen's guide says to (a later success
// "true" for the same event is a new one), with eventCode as the type.
// The handler gets a notification ({"notificationItems": [...]}) with only
// the items not processed before, and of each only what its HMAC covers
// (adyenSignedOnly): reason, paymentMethod, eventDate, operations, the
// rest of additionalData and the notification's "live" are not signed and
// never reach the handler; read them from Adyen's API by pspReference if
// the handler needs them. A notification whose items all ran before is answered
// "[accepted]", the acknowledgement Adyen expects (the handler must
// answer it too). Asynchronous mode is not supported.
func Adyen(hmacKeys ...string) Preset {
	return preset(senderPreset{source: "adyen", name: "Adyen", key: batchOnly, fingerprint: NoFingerprint,
		ttl: AdyenRetention, secrets: hmacKeys, verifier: AdyenVerifier,
		batch: &batchSpec{split: adyenItems,
			event: func(raw json.RawMessage) (string, string) {
				var it adyenItem
				if json.Unmarshal(raw, &it) != nil || it.PspReference == "" || it.EventCode == "" {
					return "", ""
				}
				return idem.JoinKey(it.EventCode, it.PspReference, it.Success), it.EventCode
			},
			ack: func(w http.ResponseWriter) {
				w.Header().Set("Content-Type", "text/plain")
				w.WriteHeader(http.StatusOK)
				_, _ = w.Write([]byte("[accepted]"))
			}}})
}
