package idemhttp_test

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// senderCase is one preset as TestSenderPresets plays it: built for the
// server's URL (the URL-covering senders sign it).
type senderCase struct {
	name string
	// make returns the sender and the preset for an endpoint at url.
	make func(url string) (*idemtest.Sender, idemhttp.Preset)
	// resendRuns: a copy under a fresh delivery id is a new event: the
	// id is signed (only the sender can make one), or the sender sends one
	// signed content as distinct events told apart by that id alone, and
	// the preset has no replay guard (Twilio's token; WooCommerce's
	// deleted and custom topics, such as the test's "thing.happened").
	resendRuns bool
	// handshake checks the preset's answer to the sender's handshake.
	handshake func(t *testing.T, hs *idemtest.Delivery, body []byte)
}

const (
	presetSecret = "idemtest genuine secret"
	adyenKey     = "44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056"
)

var senderCases = []senderCase{
	{name: "slack", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Slack(presetSecret), idemhttp.Slack(presetSecret)
	}, handshake: func(t *testing.T, hs *idemtest.Delivery, body []byte) {
		var in, out struct{ Challenge string }
		_ = json.Unmarshal(hs.Body, &in)
		if json.Unmarshal(body, &out) != nil || out.Challenge != in.Challenge || in.Challenge == "" {
			t.Fatalf("url_verification answered %s, want the challenge %q", body, in.Challenge)
		}
	}},
	{name: "zoom", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Zoom(presetSecret), idemhttp.Zoom(presetSecret)
	}, handshake: func(t *testing.T, hs *idemtest.Delivery, body []byte) {
		var in struct{ Payload struct{ PlainToken string } }
		var out struct{ PlainToken, EncryptedToken string }
		_ = json.Unmarshal(hs.Body, &in)
		want := idemtest.ZoomEncryptedToken(presetSecret, in.Payload.PlainToken)
		if json.Unmarshal(body, &out) != nil || out.PlainToken != in.Payload.PlainToken || out.EncryptedToken != want {
			t.Fatalf("endpoint.url_validation answered %s, want plainToken %q and encryptedToken %s", body, in.Payload.PlainToken, want)
		}
	}},
	{name: "twitch", resendRuns: true, make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Twitch(presetSecret), idemhttp.Twitch(presetSecret)
	}, handshake: func(t *testing.T, hs *idemtest.Delivery, body []byte) {
		var in struct{ Challenge string }
		_ = json.Unmarshal(hs.Body, &in)
		if string(body) != in.Challenge || in.Challenge == "" {
			t.Fatalf("callback verification answered %q, want the challenge %q", body, in.Challenge)
		}
	}},
	{name: "discord", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		s := idemtest.Discord()
		return s, idemhttp.Discord(s.VerificationKey(""))
	}, handshake: func(t *testing.T, _ *idemtest.Delivery, body []byte) {
		if strings.TrimSpace(string(body)) != `{"type":1}` {
			t.Fatalf("PING answered %q, want {\"type\":1}", body)
		}
	}},
	{name: "paddle", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Paddle(presetSecret), idemhttp.Paddle(presetSecret)
	}},
	{name: "pagerduty", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.PagerDuty(presetSecret), idemhttp.PagerDuty(presetSecret)
	}},
	{name: "typeform", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Typeform(presetSecret), idemhttp.Typeform(presetSecret)
	}},
	{name: "intercom", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Intercom(presetSecret), idemhttp.Intercom(presetSecret)
	}},
	{name: "woocommerce", resendRuns: true, make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.WooCommerce(presetSecret), idemhttp.WooCommerce(presetSecret)
	}},
	{name: "bitbucket", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Bitbucket(presetSecret), idemhttp.Bitbucket(presetSecret)
	}},
	{name: "gitlab", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.GitLab(presetSecret), idemhttp.GitLab(presetSecret)
	}},
	{name: "linear", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Linear(presetSecret), idemhttp.Linear(presetSecret)
	}},
	{name: "twilio", resendRuns: true, make: func(url string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Twilio(presetSecret, url), idemhttp.Twilio(idemhttp.PublicURL{}, presetSecret)
	}},
	{name: "twilio_json", resendRuns: true, make: func(url string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.TwilioJSON(presetSecret, url), idemhttp.Twilio(idemhttp.PublicURL{}, presetSecret)
	}},
	{name: "square", make: func(url string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Square(presetSecret, url), idemhttp.Square(idemhttp.PublicURL{}, presetSecret)
	}},
	{name: "hubspot", make: func(url string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.HubSpot(presetSecret, url), idemhttp.HubSpot(idemhttp.PublicURL{}, presetSecret)
	}},
	{name: "adyen", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Adyen(adyenKey), idemhttp.Adyen(adyenKey)
	}},
	{name: "sendgrid", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		s := idemtest.SendGrid()
		return s, idemhttp.SendGrid(s.VerificationKey(""))
	}},
	{name: "mailgun", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Mailgun(presetSecret), idemhttp.Mailgun(presetSecret)
	}},
	{name: "calendly", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
		return idemtest.Calendly(presetSecret), idemhttp.Calendly(presetSecret)
	}},
}

// lateHandler lets a server start before the handler that needs its URL.
type lateHandler struct{ h http.Handler }

func (l *lateHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) { l.h.ServeHTTP(w, r) }

// TestSenderPresets: every preset of the second set, against deliveries
// signed as its sender signs them (idemtest; the signatures themselves are
// checked against the senders' own libraries in
// internal/sendersigned). For each: the handshake, where the sender has
// one, is answered as the sender expects and runs and stores nothing; a
// genuine event runs once; its redelivery is answered from the stored
// answer; a forged copy is refused (401), a stale one too where the
// scheme signs a timestamp; a copy under a fresh delivery id runs nothing
// (or, where the id is signed, is a new event); and a storm of 20
// concurrent copies of a new event runs the handler once.
func TestSenderPresets(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 40)
	client := testdb.Client(t, pool, nil)
	for _, tc := range senderCases {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			runs := idemtest.Count(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock() // one at a time: the storm's copies are in flight together
				time.Sleep(20 * time.Millisecond)
				mu.Unlock()
				w.Header().Set("Content-Type", "application/json")
				w.Write([]byte(`{"ok":true}`))
			}))
			late := &lateHandler{}
			srv := httptest.NewServer(late)
			t.Cleanup(srv.Close)
			url := srv.URL + "/webhooks/" + tc.name + "?tenant=1"
			sender, preset := tc.make(url)
			mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "presets-" + tc.name}.Apply(preset))
			if err != nil {
				t.Fatal(err)
			}
			late.h = mw(runs)

			if hs := sender.Handshake(); hs != nil {
				resp, body := idemtest.Send(t, url, hs)
				if resp.StatusCode != 200 {
					t.Fatalf("handshake: %d %s", resp.StatusCode, body)
				}
				tc.handshake(t, hs, body)
				if resp, _ := idemtest.Send(t, url, sender.Forge(hs)); resp.StatusCode != 401 {
					t.Fatalf("forged handshake: %d, want 401", resp.StatusCode)
				}
				if runs.Total() != 0 || countKeys(t, pool, "presets-"+tc.name) != 0 {
					t.Fatalf("the handshake ran the handler (%d) or stored a key", runs.Total())
				}
			} else if tc.handshake != nil {
				t.Fatal("the sender has no handshake")
			}

			ev := sender.Event("thing.happened", "")
			if resp, body := idemtest.Send(t, url, ev); resp.StatusCode != 200 {
				t.Fatalf("genuine: %d %s", resp.StatusCode, body)
			}
			if resp, _ := idemtest.Send(t, url, sender.Redeliver(ev)); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
				t.Fatalf("redelivery: %d replayed=%q", resp.StatusCode, resp.Header.Get(idemhttp.ReplayedHeader))
			}
			other := sender.Event("thing.happened", "")
			if resp, _ := idemtest.Send(t, url, sender.Forge(other)); resp.StatusCode != 401 {
				t.Fatalf("forged: %d, want 401", resp.StatusCode)
			}
			if sender.SignsTime() {
				if resp, _ := idemtest.Send(t, url, sender.Stale(other, 2*time.Hour)); resp.StatusCode != 401 {
					t.Fatalf("stale: %d, want 401", resp.StatusCode)
				}
				if resp, _ := idemtest.Send(t, url, sender.Stale(other, -2*time.Hour)); resp.StatusCode != 401 {
					t.Fatalf("from the future: %d, want 401", resp.StatusCode)
				}
			}
			copyRuns := 0
			if tc.resendRuns {
				copyRuns = 1
			}
			if resp, _ := idemtest.Send(t, url, sender.Resend(ev)); resp.StatusCode != 200 {
				t.Fatalf("copy under a fresh id: %d", resp.StatusCode)
			}
			if got := runs.Total(); got != 1+copyRuns {
				t.Fatalf("after the event, its redelivery, forged, stale and resent copies: %d runs, want %d", got, 1+copyRuns)
			}

			storm := sender.Event("thing.stormed", "")
			codes := idemtest.Fire(t, url, storm, 20)
			if i := slices.IndexFunc(codes, func(c int) bool { return c != 200 && c != 409 }); i >= 0 {
				t.Fatalf("storm codes %v", codes)
			}
			if got := runs.Total(); got != 2+copyRuns {
				t.Fatalf("a storm of 20 copies: %d runs in all, want %d (the storm ran the handler %d times)", got, 2+copyRuns, got-1-copyRuns)
			}
		})
	}
}

// countKeys counts the keys stored under source (and its replay guard's).
func countKeys(t *testing.T, pool *pgxpool.Pool, source string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM idem.processed_events WHERE source = $1 OR source = $1 || '/bodies'", source).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}
