package sendersigned_test

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/twilio/twilio-go/client"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// Twilio sends identical signed content as distinct events: a GET carries
// its parameters in the signed query and has no body, and a looping
// <Gather> posts the same parameters to the same URL for every key press.
// Each request carries its own I-Twilio-Idempotency-Token, which Twilio
// keeps when it retries. These tests sign every request with Twilio's own
// code (the Node library's getExpectedTwilioSignature) and check it with
// twilio-go's RequestValidator before the preset sees it.

func sid(prefix string) string {
	b := make([]byte, 16)
	_, _ = rand.Read(b)
	return prefix + hex.EncodeToString(b)
}

// twilioSigned returns a delivery of params to u as Twilio sends it with
// method: a GET with params in the query, or a POST of the form; signed by
// the twilio Node library, and accepted by twilio-go's validator.
func twilioSigned(t *testing.T, o *oracle, method, u string, params url.Values) *idemtest.Delivery {
	t.Helper()
	flat := map[string]string{}
	for k := range params {
		flat[k] = params.Get(k)
	}
	d := &idemtest.Delivery{Sender: "twilio", Method: method, ID: sid(""),
		Header: http.Header{"User-Agent": {"TwilioProxy/1.1"}}}
	d.Header.Set("I-Twilio-Idempotency-Token", d.ID)
	signedURL, signedParams := u, flat
	if method == http.MethodGet {
		d.Query = params.Encode()
		signedURL, signedParams = u+"&"+d.Query, map[string]string{}
	} else {
		d.Body = []byte(params.Encode())
		d.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	ok, sig := o.ask(t, map[string]any{"op": "twilio.sign", "key": secret, "url": signedURL, "params": signedParams})
	if !ok || sig == "" {
		t.Fatalf("twilio's getExpectedTwilioSignature failed: %q", sig)
	}
	d.Header.Set("X-Twilio-Signature", sig)
	v := client.NewRequestValidator(secret)
	if !v.Validate(signedURL, signedParams, sig) {
		t.Fatalf("twilio-go's RequestValidator refuses the delivery Twilio's Node library signed: %s", signedURL)
	}
	return d
}

// retry is Twilio's retry of d: the same request, the same token.
func retry(d *idemtest.Delivery) *idemtest.Delivery {
	r := *d
	r.Header = d.Header.Clone()
	return &r
}

// twilioServer is a Twilio preset in front of h, at /voice?tenant=1.
func twilioServer(t *testing.T, source string, h http.Handler) string {
	t.Helper()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: source}.Apply(idemhttp.Twilio(idemhttp.PublicURL{}, secret)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return srv.URL + "/voice?tenant=1"
}

// counter counts the handler's runs per key (a CallSid, a token).
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) add(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = map[string]int{}
	}
	c.n[k]++
	return c.n[k]
}

func (c *counter) get(k string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[k]
}

// TestTwilioGET: three distinct GET deliveries (the "HTTP GET" setting of
// a number or a status callback), each its own CallSid and token, with an
// empty body, run the handler once each; Twilio's retry of one is
// answered from its stored answer; a delivery whose first attempt failed
// (500) runs on Twilio's retry; the token of one re-sent with another
// delivery's signed query is 422 and runs nothing. Before, every GET had
// one replay-guard key (the event type and the empty body): the second
// and third were answered 200 {"duplicate":true} without running.
func TestTwilioGET(t *testing.T) {
	t.Parallel()
	o := startOracle(t)
	var runs counter
	var failOnce sync.Map
	u := twilioServer(t, "twilio-get", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		call := r.URL.Query().Get("CallSid")
		if r.Method != http.MethodGet || call == "" {
			t.Errorf("the handler got %s %s", r.Method, r.URL)
		}
		runs.add(call)
		if _, fail := failOnce.LoadAndDelete(call); fail {
			http.Error(w, "database down", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/xml")
		w.Write([]byte(`<?xml version="1.0" encoding="UTF-8"?><Response/>`))
	}))
	var ds []*idemtest.Delivery
	for range 4 {
		ds = append(ds, twilioSigned(t, o, http.MethodGet, u, url.Values{"AccountSid": {sid("AC")}, "CallSid": {sid("CA")},
			"CallStatus": {"completed"}, "From": {"+15005550001"}, "To": {"+15005550006"}, "ApiVersion": {"2010-04-01"}}))
	}
	callOf := func(d *idemtest.Delivery) string { q, _ := url.ParseQuery(d.Query); return q.Get("CallSid") }
	for i, d := range ds[:3] {
		resp, body := idemtest.Send(t, u, d)
		if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" || !strings.Contains(string(body), "<Response/>") {
			t.Fatalf("GET delivery %d: %d replayed=%q %s; want the handler's 200", i+1, resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader), body)
		}
	}
	resp, body := idemtest.Send(t, u, retry(ds[1]))
	if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" || !strings.Contains(string(body), "<Response/>") {
		t.Fatalf("Twilio's retry: %d replayed=%q %s; want the stored answer", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader), body)
	}
	failOnce.Store(callOf(ds[3]), true)
	if resp, _ := idemtest.Send(t, u, ds[3]); resp.StatusCode != 500 {
		t.Fatalf("the failing first attempt: %d, want the handler's 500", resp.StatusCode)
	}
	if resp, _ := idemtest.Send(t, u, retry(ds[3])); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" {
		t.Fatalf("the retry after a failed first attempt: %d replayed=%q, want it run", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
	}
	swapped := retry(ds[2])
	swapped.Header.Set("I-Twilio-Idempotency-Token", ds[0].Header.Get("I-Twilio-Idempotency-Token"))
	if resp, _ := idemtest.Send(t, u, swapped); resp.StatusCode != http.StatusUnprocessableEntity {
		t.Fatalf("a token re-sent with another delivery's signed query: %d, want 422", resp.StatusCode)
	}
	for i, d := range ds {
		want := 1
		if i == 3 {
			want = 2 // the failed attempt and the retry
		}
		if n := runs.get(callOf(d)); n != want {
			t.Errorf("GET delivery %d ran %d times, want %d", i+1, n, want)
		}
	}
}

// TestTwilioRepeatedGather: a caller presses 1 twice in a looping
// <Gather> menu; Twilio posts the same signed parameters to the same URL
// twice, each with its own token. Both presses run the handler and get
// its TwiML; Twilio's retry of the second press (its token) is answered
// from the stored TwiML and runs nothing. Before, the second press met
// the replay guard of the first's body and was answered JSON
// ({"duplicate":true}): the caller heard an application error.
func TestTwilioRepeatedGather(t *testing.T) {
	t.Parallel()
	o := startOracle(t)
	var runs counter
	const twiml = `<?xml version="1.0" encoding="UTF-8"?><Response><Gather numDigits="1" action="/voice?tenant=1"><Say>Press 1 to hear your balance again.</Say></Gather></Response>`
	u := twilioServer(t, "twilio-gather", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.add(r.Header.Get("I-Twilio-Idempotency-Token"))
		w.Header().Set("Content-Type", "text/xml")
		w.Write([]byte(twiml))
	}))
	press := url.Values{"AccountSid": {sid("AC")}, "CallSid": {sid("CA")}, "CallStatus": {"in-progress"}, "Digits": {"1"},
		"FinishedOnKey": {""}, "From": {"+15005550001"}, "To": {"+15005550006"}, "ApiVersion": {"2010-04-01"}}
	first := twilioSigned(t, o, http.MethodPost, u, press)
	second := twilioSigned(t, o, http.MethodPost, u, press)
	if string(first.Body) != string(second.Body) || first.Header.Get("X-Twilio-Signature") != second.Header.Get("X-Twilio-Signature") {
		t.Fatal("the two presses are not the same signed request")
	}
	for i, d := range []*idemtest.Delivery{first, second} {
		resp, body := idemtest.Send(t, u, d)
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/xml" || string(body) != twiml || resp.Header.Get(idemhttp.ReplayedHeader) != "" {
			t.Fatalf("press %d: %d %s replayed=%q %s; want the handler's TwiML", i+1, resp.StatusCode, resp.Header.Get("Content-Type"), resp.Header.Get(idemhttp.ReplayedHeader), body)
		}
	}
	resp, body := idemtest.Send(t, u, retry(second))
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/xml" || string(body) != twiml || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("Twilio's retry of the second press: %d %s replayed=%q %s; want the stored TwiML", resp.StatusCode, resp.Header.Get("Content-Type"), resp.Header.Get(idemhttp.ReplayedHeader), body)
	}
	for i, d := range []*idemtest.Delivery{first, second} {
		if n := runs.get(d.Header.Get("I-Twilio-Idempotency-Token")); n != 1 {
			t.Errorf("press %d ran %d times, want once", i+1, n)
		}
	}
}
