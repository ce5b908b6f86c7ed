package idemhttp_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// syncBuffer is a log sink safe for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestTwilioBehindProxy: Twilio signs the public URL it calls
// (https://hooks.example.com/...). The receiver sits behind a TLS
// terminating reverse proxy (httputil.ReverseProxy, setting
// X-Forwarded-Host and X-Forwarded-Proto) on a plain-HTTP port. With the
// proxy trusted (PublicURL.TrustedProxies), form and JSON deliveries
// verify and run once. Misconfigured (the proxy not trusted, or a wrong
// Base), every delivery is refused 401 and the log names the URL computed
// and the URL the signature matches, so the fix is in the log line; and a
// client that sends X-Forwarded-* itself, straight to the receiver, is not
// believed.
func TestTwilioBehindProxy(t *testing.T) {
	t.Parallel()
	pool := testdb.Pool(t, testdb.New(t), 10)
	client := testdb.Client(t, pool, nil)
	const public = "https://hooks.example.com/twilio/sms?tenant=7"
	loopback := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8"), netip.MustParsePrefix("::1/128")}

	for _, tc := range []struct {
		name    string
		pub     idemhttp.PublicURL
		ok      bool
		expect  string // the URL the log names as matching
		compute string // a prefix of the URL the log names as computed
	}{
		{name: "trusted proxy", pub: idemhttp.PublicURL{TrustedProxies: loopback}, ok: true},
		{name: "configured base", pub: idemhttp.PublicURL{Base: "https://hooks.example.com"}, ok: true},
		{name: "proxy not trusted", pub: idemhttp.PublicURL{}, expect: public, compute: "http://127.0.0.1:"},
		{name: "wrong base", pub: idemhttp.PublicURL{Base: "https://old.example.com"}, expect: public, compute: "https://old.example.com/twilio/sms?tenant=7"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			logs := &syncBuffer{}
			runs := idemtest.Count(nil)
			mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "twilio-proxy-" + strings.ReplaceAll(tc.name, " ", "-"),
				Logger: slog.New(slog.NewTextHandler(logs, nil))}.Apply(idemhttp.Twilio(tc.pub, "twilio auth token")))
			if err != nil {
				t.Fatal(err)
			}
			backend := httptest.NewServer(mw(runs))
			t.Cleanup(backend.Close)
			target, _ := url.Parse(backend.URL)
			proxy := httptest.NewTLSServer(&httputil.ReverseProxy{Rewrite: func(pr *httputil.ProxyRequest) {
				pr.SetURL(target)
				pr.SetXForwarded() // X-Forwarded-For, -Host (the public host), -Proto (https: TLS ended here)
			}})
			t.Cleanup(proxy.Close)
			via := func(d *idemtest.Delivery) *http.Response {
				t.Helper()
				req, err := d.Request(context.Background(), proxy.URL+"/twilio/sms?tenant=7")
				if err != nil {
					t.Fatal(err)
				}
				req.Host = "hooks.example.com" // what Twilio dials
				resp, err := proxy.Client().Do(req)
				if err != nil {
					t.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				return resp
			}

			for _, sender := range []*idemtest.Sender{idemtest.Twilio("twilio auth token", public), idemtest.TwilioJSON("twilio auth token", public)} {
				ev := sender.Event("delivered", "")
				resp := via(ev)
				if !tc.ok {
					if resp.StatusCode != 401 {
						t.Fatalf("misconfigured: %d, want 401", resp.StatusCode)
					}
					continue
				}
				if resp.StatusCode != 200 {
					t.Fatalf("behind the proxy: %d, want 200; log:\n%s", resp.StatusCode, logs.String())
				}
				if resp := via(sender.Redeliver(ev)); resp.StatusCode != 200 || resp.Header.Get(idemhttp.ReplayedHeader) != "true" {
					t.Fatalf("redelivery: %d", resp.StatusCode)
				}
				runs.AssertOnce(t, ev)
			}
			if !tc.ok {
				if runs.Total() != 0 {
					t.Fatalf("a refused delivery ran the handler %d times", runs.Total())
				}
				log := logs.String()
				if !strings.Contains(log, `expected_url="`+tc.expect+`"`) || !strings.Contains(log, `computed_url="`+tc.compute) {
					t.Fatalf("the log does not name the expected URL %s and the computed one %s...:\n%s", tc.expect, tc.compute, log)
				}
			}
		})
	}

	// Forwarded headers from a peer that is not a trusted proxy are not
	// believed: a client straight at the receiver cannot choose the URL.
	t.Run("untrusted forwarded headers", func(t *testing.T) {
		t.Parallel()
		mw, err := idemhttp.New(idemhttp.Config{Client: client, Source: "twilio-direct", Logger: slog.New(slog.DiscardHandler)}.
			Apply(idemhttp.Twilio(idemhttp.PublicURL{TrustedProxies: []netip.Prefix{netip.MustParsePrefix("10.0.0.0/8")}}, "twilio auth token")))
		if err != nil {
			t.Fatal(err)
		}
		runs := idemtest.Count(nil)
		srv := httptest.NewServer(mw(runs))
		t.Cleanup(srv.Close)
		ev := idemtest.Twilio("twilio auth token", public).Event("delivered", "")
		ev.Header.Set("X-Forwarded-Host", "hooks.example.com")
		ev.Header.Set("X-Forwarded-Proto", "https")
		if resp, _ := idemtest.Send(t, srv.URL+"/twilio/sms?tenant=7", ev); resp.StatusCode != 401 || runs.Total() != 0 {
			t.Fatalf("forwarded headers from an untrusted peer: %d, %d runs; want 401, none", resp.StatusCode, runs.Total())
		}
	})
}
