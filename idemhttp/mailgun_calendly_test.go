package idemhttp_test

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// recordingServer serves mw around a handler that records every body it
// ran with and answers fail() (200 when it returns 0).
type recordingServer struct {
	url  string
	mu   sync.Mutex
	ran  [][]byte
	fail atomic.Int32
}

func newRecordingServer(t *testing.T, preset idemhttp.Preset, source string) *recordingServer {
	t.Helper()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 8), nil)
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: source}.Apply(preset))
	if err != nil {
		t.Fatal(err)
	}
	rs := &recordingServer{}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var b strings.Builder
		buf := make([]byte, 4096)
		for {
			n, err := r.Body.Read(buf)
			b.Write(buf[:n])
			if err != nil {
				break
			}
		}
		rs.mu.Lock()
		rs.ran = append(rs.ran, []byte(b.String()))
		rs.mu.Unlock()
		if code := rs.fail.Load(); code != 0 {
			w.WriteHeader(int(code))
			return
		}
		w.Write([]byte(`{"ok":true}`))
	})))
	t.Cleanup(srv.Close)
	rs.url = srv.URL + "/hooks"
	return rs
}

func (rs *recordingServer) runs() [][]byte {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return append([][]byte(nil), rs.ran...)
}

// withEventData returns a Mailgun body with its signature object kept as
// it is and event-data replaced: what anyone holding one delivery can send.
func withEventData(t *testing.T, body []byte, eventData string) []byte {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatal(err)
	}
	m["event-data"] = json.RawMessage(eventData)
	b, _ := json.Marshal(m)
	return b
}

// TestMailgunSignsTheTokenOnly: Mailgun's signature covers the timestamp
// and the token, not event-data. The preset keys by the signed token and
// binds event-data to it: a captured signature with other event-data is
// 422 and runs nothing, before the genuine delivery completed (its first
// attempt failed, the key released) and after; the sender's retry then
// runs the genuine event-data. A timestamp more than MailgunTolerance away
// either way is refused; one 20 hours old (a retry late in Mailgun's
// 8-hour schedule, delayed) is accepted. A digit moved between the
// timestamp and the token (the same HMAC input) is refused. A
// subaccount's delivery verified by parent-signature alone is accepted.
func TestMailgunSignsTheTokenOnly(t *testing.T) {
	t.Parallel()
	const key = "mailgun signing key"
	rs := newRecordingServer(t, idemhttp.Mailgun(key), "mailgun-token")
	sender := idemtest.Mailgun(key)

	t.Run("event-data is bound to the token", func(t *testing.T) {
		ev := sender.Event("delivered", `{"order":"A-1"}`)
		rs.fail.Store(500)
		if resp, _ := idemtest.Send(t, rs.url, ev); resp.StatusCode != 500 {
			t.Fatalf("failing first attempt: %d", resp.StatusCode)
		}
		rs.fail.Store(0)
		var data map[string]any
		var b struct {
			EventData map[string]any `json:"event-data"`
		}
		_ = json.Unmarshal(ev.Body, &b)
		data = b.EventData
		data["event"] = "failed"
		data["user-variables"] = map[string]any{"order": "B-2"}
		altered, _ := json.Marshal(data)
		copyOf := &idemtest.Delivery{Sender: "mailgun", ID: ev.ID, Body: withEventData(t, ev.Body, string(altered)), Header: ev.Header.Clone()}
		before := len(rs.runs())
		if resp, body := idemtest.Send(t, rs.url, copyOf); resp.StatusCode != 422 {
			t.Fatalf("the captured signature with other event-data after a failed first attempt: %d %s, want 422", resp.StatusCode, body)
		}
		if resp, body := idemtest.Send(t, rs.url, sender.Redeliver(ev)); resp.StatusCode != 200 {
			t.Fatalf("the sender's retry: %d %s", resp.StatusCode, body)
		}
		if resp, _ := idemtest.Send(t, rs.url, copyOf); resp.StatusCode != 422 {
			t.Fatalf("the captured signature with other event-data after the event ran: %d, want 422", resp.StatusCode)
		}
		runs := rs.runs()[before:]
		if len(runs) != 1 || !strings.Contains(string(runs[0]), `"A-1"`) {
			t.Fatalf("after the failed attempt the handler ran %d times (%q), want once on the genuine event-data", len(runs), runs)
		}
	})

	t.Run("timestamps", func(t *testing.T) {
		for _, tc := range []struct {
			age  time.Duration
			want int
		}{{20 * time.Hour, 200}, {-20 * time.Hour, 200}, {25 * time.Hour, 401}, {-25 * time.Hour, 401}, {72 * time.Hour, 401}} {
			d := sender.Stale(sender.Event("opened", ""), tc.age)
			if resp, body := idemtest.Send(t, rs.url, d); resp.StatusCode != tc.want {
				t.Errorf("signed %v ago: %d %s, want %d", tc.age, resp.StatusCode, body, tc.want)
			}
		}
	})

	t.Run("a digit moved between timestamp and token", func(t *testing.T) {
		ev := sender.Event("clicked", "")
		var m map[string]json.RawMessage
		_ = json.Unmarshal(ev.Body, &m)
		var sig map[string]string
		_ = json.Unmarshal(m["signature"], &sig)
		// The token is hex: prepend a digit to it, taken from the end of
		// the timestamp; timestamp+token is the same string, so the HMAC
		// still matches.
		ts := sig["timestamp"]
		sig["timestamp"], sig["token"] = ts[:len(ts)-1], ts[len(ts)-1:]+sig["token"]
		m["signature"], _ = json.Marshal(sig)
		body, _ := json.Marshal(m)
		moved := &idemtest.Delivery{Sender: "mailgun", Body: body, Header: ev.Header.Clone()}
		before := len(rs.runs())
		if resp, _ := idemtest.Send(t, rs.url, moved); resp.StatusCode != 401 {
			t.Fatalf("timestamp %s, token %s…: %d, want 401", sig["timestamp"], sig["token"][:4], resp.StatusCode)
		}
		if len(rs.runs()) != before {
			t.Fatal("the handler ran")
		}
	})

	t.Run("parent-signature", func(t *testing.T) {
		const parentKey = "primary account key"
		sub := newRecordingServer(t, idemhttp.Mailgun(parentKey), "mailgun-parent")
		ev := idemtest.Mailgun("subaccount key").Event("delivered", "")
		var m map[string]json.RawMessage
		_ = json.Unmarshal(ev.Body, &m)
		var sig map[string]string
		_ = json.Unmarshal(m["signature"], &sig)
		mac := hmac.New(sha256.New, []byte(parentKey))
		mac.Write([]byte(sig["timestamp"] + sig["token"]))
		sig["parent-signature"] = hex.EncodeToString(mac.Sum(nil))
		m["signature"], _ = json.Marshal(sig)
		ev.Body, _ = json.Marshal(m)
		if resp, body := idemtest.Send(t, sub.url, ev); resp.StatusCode != 200 || len(sub.runs()) != 1 {
			t.Fatalf("verified by parent-signature: %d %s, %d runs", resp.StatusCode, body, len(sub.runs()))
		}
	})

	t.Run("malformed", func(t *testing.T) {
		for name, body := range map[string]string{
			"no signature":     `{"event-data":{"event":"opened"}}`,
			"form encoded":     `timestamp=1&token=abc&signature=00`,
			"signed timestamp": `{"signature":{"timestamp":"+1700000000","token":"t","signature":"00"},"event-data":{}}`,
		} {
			d := &idemtest.Delivery{Sender: "mailgun", Body: []byte(body), Header: http.Header{"Content-Type": {"application/json"}}}
			if resp, _ := idemtest.Send(t, rs.url, d); resp.StatusCode != 400 {
				t.Errorf("%s: %d, want 400", name, resp.StatusCode)
			}
		}
	})
}

// TestCalendlyKeysOnWhatItSigns: Calendly's events carry no id; the
// preset keys on the signed event name, created_at and payload.uri. A
// rescheduling (invitee.canceled on the old invitee, invitee.created on
// the new one, at one created_at) is two events and both run; the sender's
// retry, signed at a new t, is answered from the stored answer; a
// timestamp more than CalendlyTolerance away either way is refused, one 30
// hours old (a late retry) accepted.
func TestCalendlyKeysOnWhatItSigns(t *testing.T) {
	t.Parallel()
	const key = "calendly signing key"
	rs := newRecordingServer(t, idemhttp.Calendly(key), "calendly-keys")
	sender := idemtest.Calendly(key)
	sign := func(body string, at time.Time) *idemtest.Delivery {
		ts := strconv.FormatInt(at.Unix(), 10)
		mac := hmac.New(sha256.New, []byte(key))
		mac.Write([]byte(ts + "." + body))
		return &idemtest.Delivery{Sender: "calendly", Body: []byte(body), Header: http.Header{"Content-Type": {"application/json"},
			"Calendly-Webhook-Signature": {"t=" + ts + ",v1=" + hex.EncodeToString(mac.Sum(nil))}}}
	}
	const at = `"created_at":"2026-11-28T05:00:00.000000Z"`
	canceled := sign(`{"event":"invitee.canceled",`+at+`,"payload":{"uri":"https://api.calendly.com/scheduled_events/E1/invitees/OLD","rescheduled":true}}`, time.Now())
	created := sign(`{"event":"invitee.created",`+at+`,"payload":{"uri":"https://api.calendly.com/scheduled_events/E2/invitees/NEW","old_invitee":"https://api.calendly.com/scheduled_events/E1/invitees/OLD"}}`, time.Now())
	for _, d := range []*idemtest.Delivery{canceled, created} {
		if resp, body := idemtest.Send(t, rs.url, d); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "" {
			t.Fatalf("rescheduling: %d %s replayed=%q", resp.StatusCode, body, resp.Header.Get(idemhttp.ReplayedHeader))
		}
	}
	retry := sign(string(created.Body), time.Now().Add(time.Second))
	if resp, _ := idemtest.Send(t, rs.url, retry); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("the retry: %d replayed=%q", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
	}
	if n := len(rs.runs()); n != 2 {
		t.Fatalf("%d runs, want 2 (both halves of the rescheduling, the retry none)", n)
	}
	for _, tc := range []struct {
		age  time.Duration
		want int
	}{{30 * time.Hour, 200}, {-30 * time.Hour, 200}, {49 * time.Hour, 401}, {-49 * time.Hour, 401}} {
		d := sender.Stale(sender.Event("invitee.created", ""), tc.age)
		if resp, body := idemtest.Send(t, rs.url, d); resp.StatusCode != tc.want {
			t.Errorf("signed %v ago: %d %s, want %d", tc.age, resp.StatusCode, body, tc.want)
		}
	}
}
