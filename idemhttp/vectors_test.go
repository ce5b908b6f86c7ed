package idemhttp_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// The senders' published test vectors, each from the test suite of the
// sender's own library (the version named), verified by the preset's
// verifier. A vector's timestamp is years old: the stamped schemes are
// given a tolerance that admits it, and the stale check is
// TestSenderPresets's.
const century = 100 * 365 * 24 * time.Hour

func vectorRequest(t *testing.T, target string, body []byte, h map[string]string) *http.Request {
	t.Helper()
	r := httptest.NewRequest(http.MethodPost, target, bytes.NewReader(body))
	for k, v := range h {
		r.Header.Set(k, v)
	}
	return r
}

func TestSenderTestVectors(t *testing.T) {
	t.Parallel()
	// twilio-go v1.31.0, client/request_validator_test.go: auth token
	// 12345, https://mycompany.com/myapp.php?foo=1&bar=2.
	twilioParams := url.Values{"Digits": {"1234"}, "CallSid": {"CA1234567890ABCDE"}, "To": {"+18005551212"}, "Caller": {"+14158675309"},
		"From": {"+14158675309"}, "ReasonConferenceEnded": {"test"}, "Reason": {"Participant"}}
	twilio, err := idemhttp.TwilioVerifier(idemhttp.PublicURL{Base: "https://mycompany.com"}, "12345")
	if err != nil {
		t.Fatal(err)
	}
	// Slack: slack-go v0.35.0, security_test.go.
	slackBody := `{"token":"aF5ynEYQH0dFN9imlgcADxDB","team_id":"XXXXXXXXX","api_app_id":"YYYYYYYYY","event":{"type":"app_mention","user":"AAAAAAAAA","text":"<@EEEEEEEEE> hello world","client_msg_id":"477cc591-ch73-a14z-4db8-g0cd76321bec","ts":"1531431954.000073","channel":"TTTTTTTTT","event_ts":"1531431954.000073"},"type":"event_callback","event_id":"TvBP7LRED7","event_time":1531431954,"authed_users":["EEEEEEEEE"]}`
	slack, err := idemhttp.SlackVerifier(century, "e6b19c573432dcc6b075501d51b51bb8")
	if err != nil {
		t.Fatal(err)
	}
	// PagerDuty: go-pagerduty v1.8.0, webhookv3/webhookv3_test.go.
	pdBody := `{"event":{"id":"01BWDWL3NYY7LUFPZCC28QUCMK","event_type":"incident.priority_updated","resource_type":"incident","occurred_at":"2021-04-26T17:36:27.458Z","agent":{"html_url":"https://acme.pagerduty.com/users/PLH1HKV","id":"PLH1HKV","self":"https://api.pagerduty.com/users/PLH1HKV","summary":"Tenex Engineer","type":"user_reference"},"client":null,"data":{"id":"PGR0VU2","type":"incident","self":"https://api.pagerduty.com/incidents/PGR0VU2","html_url":"https://acme.pagerduty.com/incidents/PGR0VU2","number":2,"status":"triggered","title":"A little bump in the road","service":{"html_url":"https://acme.pagerduty.com/services/PF9KMXH","id":"PF9KMXH","self":"https://api.pagerduty.com/services/PF9KMXH","summary":"API Service","type":"service_reference"},"assignees":[{"html_url":"https://acme.pagerduty.com/users/PTUXL6G","id":"PTUXL6G","self":"https://api.pagerduty.com/users/PTUXL6G","summary":"User 123","type":"user_reference"}],"escalation_policy":{"html_url":"https://acme.pagerduty.com/escalation_policies/PUS0KTE","id":"PUS0KTE","self":"https://api.pagerduty.com/escalation_policies/PUS0KTE","summary":"Default","type":"escalation_policy_reference"},"teams":[{"html_url":"https://acme.pagerduty.com/teams/PFCVPS0","id":"PFCVPS0","self":"https://api.pagerduty.com/teams/PFCVPS0","summary":"Engineering","type":"team_reference"}],"priority":{"html_url":"https://acme.pagerduty.com/account/incident_priorities","id":"PSO75BM","self":"https://api.pagerduty.com/priorities/PSO75BM","summary":"P1","type":"priority_reference"},"urgency":"high","conference_bridge":{"conference_number":1000,"conference_url":"https://example.com"},"resolve_reason":null}}}`
	pd, err := idemhttp.PagerDutyVerifier("lDQHScfUeXUKaQRNF+8XIiDKZ7XX3itBAYzwU0TARw8lJqRnkKl2iB1anSb0Z+IK")
	if err != nil {
		t.Fatal(err)
	}
	// SendGrid: sendgrid-go v3.16.1, helpers/eventwebhook/eventwebhook_test.go.
	var sgBuf bytes.Buffer
	enc := json.NewEncoder(&sgBuf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode([]map[string]any{{"email": "hello@world.com", "event": "dropped", "reason": "Bounced Address",
		"sg_event_id": "ZHJvcC0xMDk5NDkxOS1MUnpYbF9OSFN0T0doUTRrb2ZTbV9BLTA", "sg_message_id": "LRzXl_NHStOGhQ4kofSm_A.filterdrecv-p3mdw1-756b745b58-kmzbl-18-5F5FC76C-9.0",
		"smtp-id": "<LRzXl_NHStOGhQ4kofSm_A@ismtpd0039p1iad1.sendgrid.net>", "timestamp": 1600112492}})
	sgBody := append(bytes.TrimSuffix(sgBuf.Bytes(), []byte("\n")), '\r', '\n')
	sg, err := idemhttp.SendGridVerifier("MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE83T4O/n84iotIvIW4mdBgQ/7dAfSmpqIM8kF9mN1flpVKS3GRqe62gw+2fNNRaINXvVpiglSI8eNEc6wEA3F+g==")
	if err != nil {
		t.Fatal(err)
	}

	// Adyen: the example of Adyen's HMAC guide, which @adyen/api-library
	// 32.1.0's calculateHmac reproduces (TestSignedByNodeLibraries/adyen).
	adyenBody := []byte(`{"live":"false","notificationItems":[{"NotificationRequestItem":{"additionalData":{"hmacSignature":"coqCmt/IZ4E3CzPvMY8zTjQVL5hYJUiBRg8UU+iCWo0="},` +
		`"amount":{"currency":"EUR","value":1130},"eventCode":"AUTHORISATION","merchantAccountCode":"TestMerchant","merchantReference":"TestPayment-1407325143704",` +
		`"pspReference":"7914073381342284","success":"true"}}]}`)
	adyen, err := idemhttp.AdyenVerifier("44782DEF547AAA06C910C43932B1EB0C71FC68D9D0C057550C48EC2ACF6BA056")
	if err != nil {
		t.Fatal(err)
	}

	for _, tc := range []struct {
		name   string
		verify idemhttp.Verifier
		req    *http.Request
		body   []byte
	}{
		{"twilio form", twilio, vectorRequest(t, "/myapp.php?foo=1&bar=2", []byte(twilioParams.Encode()),
			map[string]string{"Content-Type": "application/x-www-form-urlencoded", "X-Twilio-Signature": "vOEb5UThFn24KEfnOFLQY2AE5FY="}), []byte(twilioParams.Encode())},
		{"twilio json", twilio, vectorRequest(t, "/myapp.php?foo=1&bar=2&bodySHA256=0a1ff7634d9ab3b95db5c9a2dfe9416e41502b283a80c7cf19632632f96e6620",
			[]byte(`{"property": "value", "boolean": true}`), map[string]string{"Content-Type": "application/json", "X-Twilio-Signature": "a9nBmqA0ju/hNViExpshrM61xv4="}),
			[]byte(`{"property": "value", "boolean": true}`)},
		{"slack", slack, vectorRequest(t, "/slack", []byte(slackBody), map[string]string{"X-Slack-Signature": "v0=adada4ed31709aef585c2580ca3267678c6a8eaeb7e0c1aca3ee57b656886b2c",
			"X-Slack-Request-Timestamp": "1531431954"}), []byte(slackBody)},
		{"pagerduty", pd, vectorRequest(t, "/pd", []byte(pdBody), map[string]string{"X-PagerDuty-Signature": "v1=0c0b9495b893a39e70d1fea2fe11fbe0a825f88b9f67846f6cc07dd2bc5476cd"}), []byte(pdBody)},
		{"sendgrid", sg, vectorRequest(t, "/sg", sgBody, map[string]string{"X-Twilio-Email-Event-Webhook-Signature": "MEUCIGHQVtGj+Y3LkG9fLcxf3qfI10QysgDWmMOVmxG0u6ZUAiEAyBiXDWzM+uOe5W0JuG+luQAbPIqHh89M15TluLtEZtM=",
			"X-Twilio-Email-Event-Webhook-Timestamp": "1600112502"}), sgBody},
		{"adyen", adyen, vectorRequest(t, "/adyen", adyenBody, nil), adyenBody},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.verify(tc.req, tc.body); err != nil {
				t.Fatalf("the sender's own test vector does not verify: %v", err)
			}
			// One byte changed: refused.
			tampered := bytes.Clone(tc.body)
			i := bytes.LastIndexByte(tampered, 'e') // inside the signed part of every vector
			tampered[i] = 'E'
			if err := tc.verify(tc.req, tampered); err == nil {
				t.Fatal("a tampered vector verifies")
			}
		})
	}
}
