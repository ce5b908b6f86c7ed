package sendersigned_test

import (
	"context"
	"crypto/ed25519"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"

	"github.com/PagerDuty/go-pagerduty/webhookv3"
	"github.com/bwmarrin/discordgo"
	"github.com/mailgun/mailgun-go/v5"
	"github.com/mailgun/mailgun-go/v5/mtypes"
	"github.com/sendgrid/sendgrid-go/helpers/eventwebhook"
	"github.com/slack-go/slack"
	"github.com/twilio/twilio-go/client"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

const secret = "sendersigned genuine secret"

// officialCase is a sender whose own Go library verifies its deliveries.
type officialCase struct {
	name string
	make func(url string) (*idemtest.Sender, idemhttp.Preset)
	// accepts is the sender's library's verdict on a delivery to url.
	accepts func(t *testing.T, s *idemtest.Sender, d *idemtest.Delivery, url string) bool
}

// request is d as the receiver gets it at url.
func request(t *testing.T, d *idemtest.Delivery, u string) *http.Request {
	t.Helper()
	r, err := d.Request(context.Background(), u)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

var officialCases = []officialCase{
	{name: "twilio", // github.com/twilio/twilio-go v1.31.0, client.RequestValidator
		make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.Twilio(secret, u), idemhttp.Twilio(idemhttp.PublicURL{}, secret)
		},
		accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, u string) bool {
			form, err := url.ParseQuery(string(d.Body))
			if err != nil {
				t.Fatal(err)
			}
			params := map[string]string{}
			for k := range form {
				params[k] = form.Get(k)
			}
			v := client.NewRequestValidator(secret)
			return v.Validate(u, params, d.Header.Get("X-Twilio-Signature"))
		}},
	{name: "twilio_json", // the same, ValidateBody (bodySHA256)
		make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.TwilioJSON(secret, u), idemhttp.Twilio(idemhttp.PublicURL{}, secret)
		},
		accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, u string) bool {
			v := client.NewRequestValidator(secret)
			return v.ValidateBody(request(t, d, u).URL.String(), d.Body, d.Header.Get("X-Twilio-Signature"))
		}},
	{name: "sendgrid", // github.com/sendgrid/sendgrid-go v3.16.1, helpers/eventwebhook
		make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			s := idemtest.SendGrid()
			return s, idemhttp.SendGrid(s.VerificationKey(""))
		},
		accepts: func(t *testing.T, s *idemtest.Sender, d *idemtest.Delivery, _ string) bool {
			key, err := eventwebhook.ConvertPublicKeyBase64ToECDSA(s.VerificationKey(""))
			if err != nil {
				t.Fatal(err)
			}
			ok, _ := eventwebhook.VerifySignature(key, d.Body, d.Header.Get("X-Twilio-Email-Event-Webhook-Signature"), d.Header.Get("X-Twilio-Email-Event-Webhook-Timestamp"))
			return ok
		}},
	{name: "pagerduty", // github.com/PagerDuty/go-pagerduty v1.8.0, webhookv3
		make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.PagerDuty(secret), idemhttp.PagerDuty(secret)
		},
		accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, u string) bool {
			return webhookv3.VerifySignature(request(t, d, u), secret) == nil
		}},
	{name: "slack", // github.com/slack-go/slack v0.35.0, SecretsVerifier (Slack publishes no Go SDK)
		make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.Slack(secret), idemhttp.Slack(secret)
		},
		accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, _ string) bool {
			sv, err := slack.NewSecretsVerifier(d.Header, secret)
			if err != nil {
				return false
			}
			_, _ = sv.Write(d.Body)
			return sv.Ensure() == nil
		}},
	{name: "mailgun", // github.com/mailgun/mailgun-go/v5 v5.17.0, VerifyWebhookSignature (Mailgun publishes no signer: idemtest signs as its guide says)
		make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.Mailgun(secret), idemhttp.Mailgun(secret)
		},
		accepts: func(t *testing.T, _ *idemtest.Sender, d *idemtest.Delivery, _ string) bool {
			var p mtypes.WebhookPayload
			if err := json.Unmarshal(d.Body, &p); err != nil {
				t.Fatal(err)
			}
			mg := mailgun.NewMailgun("key-not-used")
			mg.SetWebhookSigningKey(secret)
			ok, err := mg.VerifyWebhookSignature(p.Signature)
			return err == nil && ok
		}},
	{name: "discord", // github.com/bwmarrin/discordgo v0.29.0, VerifyInteraction (Discord publishes no Go SDK)
		make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			s := idemtest.Discord()
			return s, idemhttp.Discord(s.VerificationKey(""))
		},
		accepts: func(t *testing.T, s *idemtest.Sender, d *idemtest.Delivery, u string) bool {
			key, _ := hex.DecodeString(s.VerificationKey(""))
			return discordgo.VerifyInteraction(request(t, d, u), ed25519.PublicKey(key))
		}},
}

// TestSignedBySendersOwnCode: for each sender with a Go library of its
// own (or its most used one), deliveries signed by idemtest are accepted
// by that library and by the preset, and run the handler once each; a
// forged copy is refused by both; the sender's handshake, where it has
// one, too.
func TestSignedBySendersOwnCode(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 20)
	c := testdb.Client(t, pool, nil)
	for _, tc := range officialCases {
		t.Run(tc.name, func(t *testing.T) {
			var h http.Handler
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h.ServeHTTP(w, r) }))
			t.Cleanup(srv.Close)
			u := srv.URL + "/hooks/" + tc.name + "?a=1&b=two"
			sender, preset := tc.make(u)
			mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "official-" + tc.name}.Apply(preset))
			if err != nil {
				t.Fatal(err)
			}
			runs := idemtest.Count(nil)
			h = mw(runs)
			var ds []*idemtest.Delivery
			for i := range 3 {
				ds = append(ds, sender.Event("thing.happened", fmt.Sprintf(`{"n":%d,"text":"caf\u00e9 & \"quotes\" + spaces"}`, i)))
			}
			if hs := sender.Handshake(); hs != nil {
				ds = append(ds, hs)
			}
			for _, d := range ds {
				if !tc.accepts(t, sender, d, u) {
					t.Fatalf("%s's own library refuses idemtest's delivery %s: %s", tc.name, d.ID, d.Body)
				}
				if resp, body := idemtest.Send(t, u, d); resp.StatusCode != 200 {
					t.Fatalf("the preset refuses a delivery %s's library accepts: %d %s", tc.name, resp.StatusCode, body)
				}
				forged := sender.Forge(d)
				if tc.accepts(t, sender, forged, u) {
					t.Fatalf("%s's own library accepts a forged delivery", tc.name)
				}
				if resp, _ := idemtest.Send(t, u, forged); resp.StatusCode != 401 {
					t.Fatalf("the preset answers a forged delivery %d, want 401", resp.StatusCode)
				}
			}
			runs.AssertOnce(t, ds[:3]...)
		})
	}
}
