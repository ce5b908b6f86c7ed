package idemhttp_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
)

// TestAdyenHandsOnlyWhatIsSigned: Adyen's HMAC covers eight fields of each
// NotificationRequestItem; reason, paymentMethod, eventDate, operations,
// the rest of additionalData and the notification's "live" are not signed.
// After the genuine notification's first attempt failed (its key
// released), a captured copy with every unsigned field changed verifies
// and gets the key, but the handler gets only the signed fields, as
// delivered, and hmacSignature: exactly what the genuine notification
// would have given it, and still valid under AdyenVerifier. The sender's
// retry is then answered "[accepted]" without running.
func TestAdyenHandsOnlyWhatIsSigned(t *testing.T) {
	t.Parallel()
	rs := newRecordingServer(t, idemhttp.Adyen(adyenKey), "adyen-signed")
	sender := idemtest.Adyen(adyenKey)
	ev := sender.Event("AUTHORISATION", `{"shopper":"alice"}`)

	rs.fail.Store(500)
	if resp, _ := idemtest.Send(t, rs.url, ev); resp.StatusCode != 500 {
		t.Fatalf("failing first attempt: %d", resp.StatusCode)
	}
	rs.fail.Store(0)
	genuine := rs.runs()[0]

	// The captured copy: every unsigned field changed or added.
	var n map[string]any
	if err := json.Unmarshal(ev.Body, &n); err != nil {
		t.Fatal(err)
	}
	n["live"] = "true"
	item := n["notificationItems"].([]any)[0].(map[string]any)["NotificationRequestItem"].(map[string]any)
	item["reason"] = "forged reason"
	item["paymentMethod"] = "forged"
	item["eventDate"] = "2001-01-01T00:00:00Z"
	item["operations"] = []string{"REFUND"}
	item["additionalData"].(map[string]any)["shopperReference"] = "mallory"
	item["additionalData"].(map[string]any)["recurring.recurringDetailReference"] = "mallory-card"
	copyBody, _ := json.Marshal(n)
	verify, err := idemhttp.AdyenVerifier(adyenKey)
	if err != nil {
		t.Fatal(err)
	}
	if err := verify(httptest.NewRequest(http.MethodPost, "/", nil), copyBody); err != nil {
		t.Fatalf("the altered copy does not verify, so the test proves nothing: %v", err)
	}
	altered := &idemtest.Delivery{Sender: "adyen", Body: copyBody, Header: ev.Header.Clone()}
	if resp, body := idemtest.Send(t, rs.url, altered); resp.StatusCode != 200 {
		t.Fatalf("the altered copy: %d %s", resp.StatusCode, body)
	}
	runs := rs.runs()
	if len(runs) != 2 {
		t.Fatalf("%d runs, want 2 (the failed attempt and the copy)", len(runs))
	}
	got := runs[1]
	for _, unsigned := range []string{"forged", "2001-01-01", "REFUND", "mallory", "live", "reason", "paymentMethod", "eventDate", "operations", "shopper"} {
		if strings.Contains(string(got), unsigned) {
			t.Errorf("the handler got %q: %s", unsigned, got)
		}
	}
	var a, b any
	_ = json.Unmarshal(got, &a)
	_ = json.Unmarshal(genuine, &b)
	if !reflect.DeepEqual(a, b) {
		t.Errorf("the handler got\n%s\nfrom the copy, and\n%s\nfrom the genuine notification: they must be the same", got, genuine)
	}
	if err := verify(httptest.NewRequest(http.MethodPost, "/", nil), got); err != nil {
		t.Errorf("what the handler got no longer verifies: %v\n%s", err, got)
	}
	for _, k := range []string{"pspReference", "merchantAccountCode", "merchantReference", "eventCode", "success", "hmacSignature", `"value":1130`, `"currency":"EUR"`} {
		if !strings.Contains(string(got), k) {
			t.Errorf("the handler did not get %s: %s", k, got)
		}
	}

	resp, body := idemtest.Send(t, rs.url, sender.Redeliver(ev))
	if resp.StatusCode != 200 || string(body) != "[accepted]" || len(rs.runs()) != 2 {
		t.Fatalf("the sender's retry: %d %q, %d runs; want [accepted], no run", resp.StatusCode, body, len(rs.runs()))
	}
}
