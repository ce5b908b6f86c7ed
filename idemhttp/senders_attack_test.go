package idemhttp_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// TestSenderPresetsRefuseBadKeys: every preset of the second set refuses
// at New, with ErrInvalidSecret, no secret, an empty or blank one, one
// with a control character (a trailing newline), in a rotation list too;
// Discord and SendGrid refuse a public key that does not parse; a
// PublicURL.Base that is not an absolute http(s) URL is refused.
func TestSenderPresetsRefuseBadKeys(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 1), nil)
	good := map[string]string{}
	for _, tc := range senderCases {
		s, _ := tc.make("http://example.com/x")
		good[tc.name] = s.VerificationKey(presetSecret)
	}
	presets := map[string]func(...string) idemhttp.Preset{
		"slack": idemhttp.Slack, "zoom": idemhttp.Zoom, "twitch": idemhttp.Twitch, "discord": idemhttp.Discord,
		"paddle": idemhttp.Paddle, "pagerduty": idemhttp.PagerDuty, "typeform": idemhttp.Typeform, "intercom": idemhttp.Intercom,
		"woocommerce": idemhttp.WooCommerce, "bitbucket": idemhttp.Bitbucket, "gitlab": idemhttp.GitLab, "linear": idemhttp.Linear,
		"sendgrid": idemhttp.SendGrid, "adyen": idemhttp.Adyen, "mailgun": idemhttp.Mailgun, "calendly": idemhttp.Calendly,
		"twilio":  func(s ...string) idemhttp.Preset { return idemhttp.Twilio(idemhttp.PublicURL{}, s...) },
		"square":  func(s ...string) idemhttp.Preset { return idemhttp.Square(idemhttp.PublicURL{}, s...) },
		"hubspot": func(s ...string) idemhttp.Preset { return idemhttp.HubSpot(idemhttp.PublicURL{}, s...) },
	}
	for name, p := range presets {
		bad := []string{"", "  ", "secret\n"}
		switch name {
		case "discord":
			bad = append(bad, "not hex", "abcd")
		case "sendgrid":
			bad = append(bad, "not base64!", "AAAA")
		case "adyen":
			bad = append(bad, "not hex")
		}
		for _, s := range bad {
			for _, list := range [][]string{{s}, {good[name], s}} {
				_, err := idemhttp.New(idemhttp.Config{Client: c, Source: fmt.Sprintf("%s-%q", name, list)}.Apply(p(list...)))
				if !errors.Is(err, idemhttp.ErrInvalidSecret) {
					t.Errorf("%s with keys %q: %v, want ErrInvalidSecret", name, list, err)
				}
			}
		}
		if _, err := idemhttp.New(idemhttp.Config{Client: c, Source: name + "-none"}.Apply(p())); err == nil || !strings.Contains(err.Error(), "VerifiedUpstream") {
			t.Errorf("%s without a key: %v, want the error that asks for one", name, err)
		}
	}
	for _, base := range []string{"hooks.example.com", "ftp://x", "https://x/?q=1", "https://"} {
		if _, err := idemhttp.New(idemhttp.Config{Client: c, Source: "base-" + base}.Apply(idemhttp.Twilio(idemhttp.PublicURL{Base: base}, "t"))); err == nil {
			t.Errorf("PublicURL.Base %q accepted", base)
		}
	}
}

// TestSenderPresetsRefuseRepeatedHeaders: a delivery that carries its
// signature (or timestamp) header twice, once genuine, is refused as
// malformed (400) before anything is claimed: which value was signed is
// not the receiver's to guess.
func TestSenderPresetsRefuseRepeatedHeaders(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	for _, tc := range []struct {
		name, header string
	}{
		{"slack", "X-Slack-Signature"}, {"zoom", "x-zm-request-timestamp"}, {"twitch", "Twitch-Eventsub-Message-Id"},
		{"discord", "X-Signature-Ed25519"}, {"paddle", "Paddle-Signature"}, {"linear", "Linear-Signature"},
		{"sendgrid", "X-Twilio-Email-Event-Webhook-Signature"}, {"gitlab", "X-Gitlab-Token"}, {"twilio", "X-Twilio-Signature"},
		{"calendly", "Calendly-Webhook-Signature"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var runs atomic.Int32
			late := &lateHandler{}
			srv := httptest.NewServer(late)
			t.Cleanup(srv.Close)
			url := srv.URL + "/h"
			var cs senderCase
			for _, s := range senderCases {
				if s.name == tc.name {
					cs = s
				}
			}
			sender, preset := cs.make(url)
			mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "repeat-" + tc.name}.Apply(preset))
			if err != nil {
				t.Fatal(err)
			}
			late.h = mw(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) }))
			d := sender.Event("thing.happened", "")
			d.Header.Add(tc.header, d.Header.Get(tc.header))
			if resp, body := idemtest.Send(t, url, d); resp.StatusCode != 400 || runs.Load() != 0 {
				t.Fatalf("a repeated %s: %d %s, %d runs; want 400, none", tc.header, resp.StatusCode, body, runs.Load())
			}
		})
	}
}

// TestBatchHandlerFailureReleases: under a multi-event preset, a handler
// that answers 500, or panics, releases every event it was given: the
// sender's retry runs them all again, once. A body that is not an array,
// or an event without an id, is 400 and claims nothing; asynchronous mode
// is refused at New.
func TestBatchHandlerFailureReleases(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 10)
	c := testdb.Client(t, pool, nil)
	sender := idemtest.SendGrid()
	var fail atomic.Int32 // 1: answer 500; 2: panic
	runs := &eventRuns{byID: map[string]int{}}
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "batch-fail"}.Apply(idemhttp.SendGrid(sender.VerificationKey(""))))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch fail.Load() {
		case 1:
			w.WriteHeader(http.StatusInternalServerError)
			return
		case 2:
			panic("handler bug")
		}
		runs.ServeHTTP(w, r)
	})))
	t.Cleanup(srv.Close)
	evs := []*idemtest.Delivery{sender.Event("open", ""), sender.Event("click", ""), sender.Event("bounce", "")}
	batch := sender.Batch(evs...)
	for mode, want := range map[int32]int{1: 500, 2: 500} {
		fail.Store(mode)
		if resp, _ := idemtest.Send(t, srv.URL, sender.Redeliver(batch)); resp.StatusCode != want {
			t.Fatalf("failing handler (mode %d): %d, want %d", mode, resp.StatusCode, want)
		}
	}
	fail.Store(0)
	if resp, _ := idemtest.Send(t, srv.URL, sender.Redeliver(batch)); resp.StatusCode != 200 {
		t.Fatalf("the retry: %d", resp.StatusCode)
	}
	if resp, _ := idemtest.Send(t, srv.URL, sender.Redeliver(batch)); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
		t.Fatalf("the next retry: %d, want a replayed 200", resp.StatusCode)
	}
	if runs.calls != 1 || len(runs.byID) != 3 {
		t.Fatalf("%d calls for %d events, want 1 for 3", runs.calls, len(runs.byID))
	}

	for _, body := range []string{`{"not":"an array"}`, `[{"event":"open"}]`, `[1,2]`} {
		d := &idemtest.Delivery{Sender: "sendgrid", Body: []byte(body), Header: batch.Header.Clone()}
		d = sender.Redeliver(d)
		if resp, _ := idemtest.Send(t, srv.URL, d); resp.StatusCode != 400 {
			t.Fatalf("body %s: %d, want 400", body, resp.StatusCode)
		}
	}
	var n int
	if err := pool.QueryRow(t.Context(), "SELECT count(*) FROM idem.processed_events WHERE source = 'batch-fail'").Scan(&n); err != nil || n != 3 {
		t.Fatalf("%d keys stored (%v), want the 3 events'", n, err)
	}
	if _, err := idemhttp.New(idemhttp.Config{Client: c, Source: "batch-async", Async: refuseAll{}}.Apply(idemhttp.SendGrid(sender.VerificationKey("")))); err == nil {
		t.Fatal("a multi-event preset accepted asynchronous mode")
	}
}

// refuseAll is an Acceptor that accepts nothing.
type refuseAll struct{}

func (refuseAll) AcceptDelivery(context.Context, *idemhttp.Delivery) (bool, error) {
	return false, errors.New("refused")
}

// captureAll is an Acceptor that keeps the deliveries it is handed.
type captureAll struct{ ds chan *idemhttp.Delivery }

func (c captureAll) AcceptDelivery(_ context.Context, d *idemhttp.Delivery) (bool, error) {
	c.ds <- d
	return false, nil
}

// TestGitLabTokenNeverStored: GitLab sends its secret token itself in
// X-Gitlab-Token; in asynchronous mode, where the kept headers are stored
// with the job, the token is not among them (the event and delivery
// headers are).
func TestGitLabTokenNeverStored(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 2), nil)
	acc := captureAll{ds: make(chan *idemhttp.Delivery, 1)}
	mw, err := idemhttp.New(idemhttp.Config{Client: c, Async: acc}.Apply(idemhttp.GitLab(presetSecret)))
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.NotFoundHandler()))
	t.Cleanup(srv.Close)
	ev := idemtest.GitLab(presetSecret).Event("Push Hook", "")
	if resp, _ := idemtest.Send(t, srv.URL, ev); resp.StatusCode != http.StatusAccepted {
		t.Fatalf("async GitLab delivery: %d, want 202", resp.StatusCode)
	}
	d := <-acc.ds
	if v := d.Header.Values("X-Gitlab-Token"); len(v) != 0 {
		t.Fatalf("the stored delivery keeps the secret token: %q", v)
	}
	if d.Header.Get("X-Gitlab-Event") != "Push Hook" || d.Header.Get("Idempotency-Key") != ev.ID {
		t.Fatalf("the stored delivery lacks GitLab's event headers: %v", d.Header)
	}
}
