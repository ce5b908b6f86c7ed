package sendersigned_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	"github.com/sendgrid/sendgrid-go/helpers/eventwebhook"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// eventIDs are the ids of the events a multi-event delivery's body holds
// (SendGrid's sg_event_id, HubSpot's eventId, Adyen's pspReference).
func eventIDs(t *testing.T, body []byte) []string {
	t.Helper()
	var ids []string
	var arr []map[string]any
	if json.Unmarshal(body, &arr) == nil {
		for _, ev := range arr {
			id, ok := ev["sg_event_id"]
			if !ok {
				id = ev["eventId"]
			}
			ids = append(ids, fmt.Sprint(id))
		}
		return ids
	}
	var n struct {
		NotificationItems []struct {
			Item struct {
				PspReference string `json:"pspReference"`
			} `json:"NotificationRequestItem"`
		} `json:"notificationItems"`
	}
	if err := json.Unmarshal(body, &n); err != nil {
		t.Errorf("not a delivery of many events: %v: %s", err, body)
	}
	for _, it := range n.NotificationItems {
		ids = append(ids, it.Item.PspReference)
	}
	return ids
}

// outage is a handler that answers each call with the next status of its
// script (200 once the script is over), counting the calls and, per
// event, the runs that succeeded (2xx).
type outage struct {
	t      *testing.T
	mu     sync.Mutex
	script []int
	calls  int
	ok     map[string]int
}

func (o *outage) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	o.mu.Lock()
	status := http.StatusOK
	if o.calls < len(o.script) {
		status = o.script[o.calls]
	}
	o.calls++
	if status/100 == 2 {
		for _, id := range eventIDs(o.t, body) {
			o.ok[id]++
		}
	}
	o.mu.Unlock()
	if status == http.StatusOK && r.Header.Get("Content-Type") == "" {
		w.Header().Set("Content-Type", "text/plain")
	}
	w.WriteHeader(status)
	_, _ = w.Write([]byte("[accepted]"))
}

func (o *outage) state() (calls int, ok map[string]int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ok = map[string]int{}
	for k, v := range o.ok {
		ok[k] = v
	}
	return o.calls, ok
}

// multiEventCase is a sender of many events per delivery, and its own
// library's verdict on a delivery (checked before it is sent).
type multiEventCase struct {
	name    string
	make    func(u string) (*idemtest.Sender, idemhttp.Preset)
	accepts func(t *testing.T, s *idemtest.Sender, d *idemtest.Delivery, u string) bool
}

func multiEventCases(t *testing.T) []multiEventCase {
	o := startOracle(t)
	const key = "multi-event genuine secret"
	const adyenKey = "00112233445566778899AABBCCDDEEFF00112233445566778899AABBCCDDEEFF"
	return []multiEventCase{
		{name: "sendgrid", // github.com/sendgrid/sendgrid-go v3.16.1, helpers/eventwebhook
			make: func(string) (*idemtest.Sender, idemhttp.Preset) {
				s := idemtest.SendGrid()
				return s, idemhttp.SendGrid(s.VerificationKey(""))
			},
			accepts: func(t *testing.T, s *idemtest.Sender, d *idemtest.Delivery, _ string) bool {
				k, err := eventwebhook.ConvertPublicKeyBase64ToECDSA(s.VerificationKey(""))
				if err != nil {
					t.Fatal(err)
				}
				ok, _ := eventwebhook.VerifySignature(k, d.Body, d.Header.Get("X-Twilio-Email-Event-Webhook-Signature"), d.Header.Get("X-Twilio-Email-Event-Webhook-Timestamp"))
				return ok
			}},
		{name: "hubspot", // Node @hubspot/api-client 13.5.0, Signature.isValid
			make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.HubSpot(key, u), idemhttp.HubSpot(idemhttp.PublicURL{}, key)
			},
			accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, u string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "hubspot.verify", "key": key, "url": u, "headers": lower(d.Header), "body": string(d.Body)})
				return ok
			}},
		{name: "adyen", // Node @adyen/api-library 32.1.0, hmacValidator.validateHMAC
			make: func(string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.Adyen(adyenKey), idemhttp.Adyen(adyenKey)
			},
			accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, _ string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "adyen.verify", "key": adyenKey, "body": string(d.Body)})
				return ok
			}},
	}
}

// serve starts a real server that hands every request to the handler
// its caller sets afterwards through the returned pointer (some senders
// sign the URL, which must be known before the preset is built).
func serve(t *testing.T) (string, *http.Handler) {
	t.Helper()
	h := new(http.Handler)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { (*h).ServeHTTP(w, r) }))
	t.Cleanup(srv.Close)
	return srv.URL, h
}

// mount sets *h to preset's middleware over source in front of next.
func mount(t *testing.T, h *http.Handler, c *idem.Client, source string, preset idemhttp.Preset, next http.Handler) {
	t.Helper()
	m, err := idemhttp.New(idemhttp.Config{Client: c, Source: source}.Apply(preset))
	if err != nil {
		t.Fatal(err)
	}
	*h = m(next)
}

// momentaryScript is n answers cycling through every momentary status.
func momentaryScript(n int) []int {
	statuses := []int{503, 429, 401, 403, 408, 409, 425}
	out := make([]int, n)
	for i := range out {
		out[i] = statuses[i%len(statuses)]
	}
	return out
}

// TestMultiEventAfterOutage (issue 50, item 4): a SendGrid, HubSpot or
// Adyen delivery of three events, signed as the sender's own library
// verifies, is answered 30 times with a momentary status (503, 429, 401,
// 403, 408, 409, 425: an outage, a rate limit, a secret being fixed),
// more than the source's max_attempts (25): each retry runs the handler
// again and gets its answer, never a 2xx it did not run for; the 31st
// runs every event once and is answered by the handler; only the retry
// after that is a duplicate. Then, under max_attempts 3, a delivery whose
// handler fails for real (500) three times is answered, on the next
// retry, exactly what the single-event path answers for a key past
// max_attempts (422, "Request failed permanently"), without running the
// handler, and never 2xx.
func TestMultiEventAfterOutage(t *testing.T) {
	t.Parallel()
	cases := multiEventCases(t)
	pool := testdb.Pool(t, testdb.New(t), 20)
	c := testdb.Client(t, pool, nil)
	ctx := context.Background()

	// The single-event path's answer for a key past max_attempts, through
	// a real server: PagerDuty, three 500s under max_attempts 3.
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ('single-failing', '7 days', '1 minute', 3)`); err != nil {
		t.Fatal(err)
	}
	single := &outage{t: t, script: []int{500, 500, 500}, ok: map[string]int{}}
	pdURL, pdh := serve(t)
	mount(t, pdh, c, "single-failing", idemhttp.PagerDuty(secret), single)
	pd := idemtest.PagerDuty(secret)
	d := pd.Event("incident.triggered", `{"n":1}`)
	for range 3 {
		if resp, body := idemtest.Send(t, pdURL, pd.Redeliver(d)); resp.StatusCode != 500 {
			t.Fatalf("single event, a failing run: %d %s", resp.StatusCode, body)
		}
	}
	resp, body := idemtest.Send(t, pdURL, pd.Redeliver(d))
	wantStatus, wantTitle := resp.StatusCode, problemTitle(t, body)
	if wantStatus != http.StatusUnprocessableEntity || wantTitle != "Request failed permanently" {
		t.Fatalf("the single-event path past max_attempts answers %d %q", wantStatus, wantTitle)
	}

	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			t.Run("momentary", func(t *testing.T) {
				h := &outage{t: t, script: momentaryScript(30), ok: map[string]int{}}
				u, mh := serve(t)
				u += "/hooks/" + tc.name
				sender, preset := tc.make(u)
				mount(t, mh, c, "outage-"+tc.name, preset, h)
				events := []*idemtest.Delivery{sender.Event("delivered", `{"n":1}`), sender.Event("open", `{"n":2}`), sender.Event("click", `{"n":3}`)}
				delivery := sender.Batch(events...)
				ids := eventIDs(t, delivery.Body)
				for i, want := range h.script {
					d := sender.Redeliver(delivery)
					if !tc.accepts(t, sender, d, u) {
						t.Fatalf("%s's own library refuses the delivery", tc.name)
					}
					resp, body := idemtest.Send(t, u, d)
					calls, _ := h.state()
					if resp.StatusCode != want || resp.Header.Get(idemhttp.ReplayedHeader) != "" || calls != i+1 {
						t.Fatalf("attempt %d in the outage: %d %q (replayed %q), the handler ran %d times; want the handler's %d each time",
							i+1, resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader), calls, want)
					}
				}
				d := sender.Redeliver(delivery)
				resp, body := idemtest.Send(t, u, d)
				calls, ok := h.state()
				if resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" || calls != 31 {
					t.Fatalf("the retry after the outage: %d %q (replayed %q), handler calls %d; want the handler run (31 calls) and its 200",
						resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader), calls)
				}
				for _, id := range ids {
					if ok[id] != 1 {
						t.Fatalf("event %s ran successfully %d times, want once (%v)", id, ok[id], ok)
					}
				}
				resp, _ = idemtest.Send(t, u, sender.Redeliver(delivery))
				if calls, _ := h.state(); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" || calls != 31 {
					t.Fatalf("the retry after success: %d replayed %q, handler calls %d; want a duplicate", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader), calls)
				}
			})
			t.Run("past_max_attempts", func(t *testing.T) {
				source := "failing-" + tc.name
				if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease, max_attempts) VALUES ($1, '35 days', '1 minute', 3)`, source); err != nil {
					t.Fatal(err)
				}
				h := &outage{t: t, script: []int{500, 500, 500}, ok: map[string]int{}}
				u, mh := serve(t)
				u += "/hooks/" + tc.name
				sender, preset := tc.make(u)
				mount(t, mh, c, source, preset, h)
				delivery := sender.Batch(sender.Event("delivered", `{"n":1}`), sender.Event("open", `{"n":2}`))
				for i := range 3 {
					d := sender.Redeliver(delivery)
					if !tc.accepts(t, sender, d, u) {
						t.Fatalf("%s's own library refuses the delivery", tc.name)
					}
					if resp, body := idemtest.Send(t, u, d); resp.StatusCode != 500 {
						t.Fatalf("failing run %d: %d %s", i+1, resp.StatusCode, body)
					}
				}
				for i := range 2 {
					resp, body := idemtest.Send(t, u, sender.Redeliver(delivery))
					calls, ok := h.state()
					if resp.StatusCode != wantStatus || problemTitle(t, body) != wantTitle || calls != 3 || len(ok) != 0 {
						t.Fatalf("retry %d past max_attempts: %d %s (handler calls %d, successes %v); want the single-event path's %d %q without running",
							i+1, resp.StatusCode, body, calls, ok, wantStatus, wantTitle)
					}
				}
			})
		})
	}
}

// problemTitle is a problem+json answer's title ("" for anything else).
func problemTitle(t *testing.T, body []byte) string {
	t.Helper()
	var p struct {
		Title string `json:"title"`
	}
	_ = json.Unmarshal(body, &p)
	return p.Title
}
