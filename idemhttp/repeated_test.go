package idemhttp_test

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// TestEveryPresetRefusesRepeatedHeaders: on every preset (Stripe, GitHub,
// Shopify and Standard Webhooks included, which read the first value
// before), a genuine delivery that carries one of its preset's signature,
// timestamp, id or event headers twice, either the genuine value twice or
// the genuine value followed by another, is answered 400 before anything
// is claimed, and the handler does not run; the same delivery with each
// header once then runs. Also under VerifiedUpstream, where the preset
// does not verify: the key header read must be the one the upstream
// verified.
func TestEveryPresetRefusesRepeatedHeaders(t *testing.T) {
	t.Parallel()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 6), nil)
	cases := append([]senderCase{
		{name: "stripe", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.Stripe("whsec_" + presetSecret), idemhttp.Stripe("whsec_" + presetSecret)
		}},
		{name: "github", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.GitHub(presetSecret), idemhttp.GitHub(presetSecret)
		}},
		{name: "shopify", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			return idemtest.Shopify(presetSecret), idemhttp.Shopify(presetSecret)
		}},
		{name: "webhooks", make: func(string) (*idemtest.Sender, idemhttp.Preset) {
			s := idemtest.StandardWebhooks("whsec_c2VjcmV0IHNlY3JldCBzZWNyZXQgc2VjcmV0")
			return s, idemhttp.StandardWebhooks("whsec_c2VjcmV0IHNlY3JldCBzZWNyZXQgc2VjcmV0")
		}},
	}, senderCases...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var runs atomic.Int32
			late := &lateHandler{}
			srv := httptest.NewServer(late)
			t.Cleanup(srv.Close)
			url := srv.URL + "/h"
			sender, preset := tc.make(url)
			mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "repeated-" + tc.name}.Apply(preset))
			if err != nil {
				t.Fatal(err)
			}
			late.h = mw(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) }))
			d := sender.Event("thing.happened", `{"n":1}`)
			tried := 0
			for _, name := range idemhttp.PresetHeaders(preset) {
				v := d.Header.Get(name)
				if v == "" {
					continue // not part of this delivery
				}
				tried++
				for _, second := range []string{v, v + "0"} {
					r := sender.Redeliver(d)
					r.Header.Add(name, second)
					if resp, body := idemtest.Send(t, url, r); resp.StatusCode != 400 || runs.Load() != 0 {
						t.Fatalf("%s repeated (%q, then %q): %d %s, %d runs; want 400, none", name, r.Header.Get(name), second, resp.StatusCode, body, runs.Load())
					}
				}
			}
			if tried == 0 && len(idemhttp.PresetHeaders(preset)) > 0 {
				t.Fatal("the delivery carries none of the preset's headers")
			} // Adyen signs inside the body: no header to repeat
			if resp, body := idemtest.Send(t, url, sender.Redeliver(d)); resp.StatusCode != 200 || runs.Load() != 1 {
				t.Fatalf("the delivery with each header once: %d %s, %d runs", resp.StatusCode, body, runs.Load())
			}
		})
	}
	t.Run("verified_upstream", func(t *testing.T) {
		t.Parallel()
		var runs atomic.Int32
		mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "repeated-upstream", VerifiedUpstream: true}.Apply(idemhttp.GitHub()))
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { runs.Add(1) })))
		t.Cleanup(srv.Close)
		d := idemtest.GitHub(presetSecret).Event("push", `{"n":1}`)
		d.Header.Add("X-GitHub-Delivery", "another-delivery")
		if resp, body := idemtest.Send(t, srv.URL, d); resp.StatusCode != 400 || runs.Load() != 0 {
			t.Fatalf("X-GitHub-Delivery repeated behind a verifying upstream: %d %s, %d runs", resp.StatusCode, body, runs.Load())
		}
	})
}
