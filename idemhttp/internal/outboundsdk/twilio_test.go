package outboundsdk_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"testing"

	"github.com/twilio/twilio-go"
	"github.com/twilio/twilio-go/client"
	twapi "github.com/twilio/twilio-go/rest/api/v2010"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// twilioAPI is a stand-in for Twilio's Messages API, which takes no
// idempotency key: every request sends a message.
func twilioAPI(lose int) *api {
	return &api{lose: lose, answer: func(w http.ResponseWriter, id, body string) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		json.NewEncoder(w).Encode(map[string]any{"sid": id, "status": "queued", "to": form(body, "To"), "body": form(body, "Body")})
	}}
}

// twilioClient is twilio-go's own client over rt. twilio-go builds every
// request with context.Background() (client.Client.SendRequest, v1.31.0)
// and its methods take no context: the caller's never reaches rt. It has
// no retry loop.
func twilioClient(rt http.RoundTripper) *twilio.RestClient {
	cl := &client.Client{Credentials: client.NewCredentials("AC0123", "token"), HTTPClient: &http.Client{Transport: rt}}
	cl.SetAccountSid("AC0123")
	return twilio.NewRestClientWithParams(twilio.ClientParams{Client: cl})
}

func sms(tc *twilio.RestClient, to string) (string, error) {
	m, err := tc.Api.CreateMessage((&twapi.CreateMessageParams{}).SetTo(to).SetFrom("+15550000000").SetBody("your order shipped"))
	if err != nil {
		return "", err
	}
	return *m.Sid, nil
}

// TestOutboundTwilio: twilio-go drops the caller's context, so the
// Transport never sees the effect a message is sent in. Decided: such a
// write is refused as outside an effect (ErrNoEffect), never sent
// unkeyed as if keyed. Twilio's Messages API takes no key anyway, so the
// way to one message is an AtMostOnce effect over a client opted out with
// AllowUnkeyed: the answer to the first send lost, the event delivered
// three times, one message, and the effect failed for good for a person
// to settle. By default (at least once) the same run sends two.
func TestOutboundTwilio(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	notify := func(tc *twilio.RestClient, order string, opts ...idem.EffectOption) (errs []error) {
		for range 3 { // the event's deliveries
			_, err := c.Do(ctx, "shop", order, func(ctx context.Context) (any, error) {
				return idem.EffectValue(ctx, c, "sms", func(context.Context) (string, error) {
					return sms(tc, "+15551234567")
				}, opts...)
			})
			errs = append(errs, err)
		}
		return errs
	}

	t.Run("its context never reaches the Transport", func(t *testing.T) {
		a := twilioAPI(0)
		rt, err := idemhttp.NewTransport(redirectTo(t, serve(t, a)), nil)
		if err != nil {
			t.Fatal(err)
		}
		errs := notify(twilioClient(rt), "order-1")
		if n, keys := a.counts(); n != 0 || len(keys) != 0 {
			t.Fatalf("%d messages sent; want none", n)
		}
		for i, err := range errs {
			if !errors.Is(err, idemhttp.ErrNoEffect) {
				t.Fatalf("delivery %d: %v, want ErrNoEffect", i+1, err)
			}
		}
	})
	t.Run("at least once by default", func(t *testing.T) {
		a := twilioAPI(1)
		rt, _ := idemhttp.NewTransport(redirectTo(t, serve(t, a)), &idemhttp.TransportConfig{AllowUnkeyed: true})
		errs := notify(twilioClient(rt), "order-2")
		if n, _ := a.counts(); n != 2 || errs[0] == nil || errs[1] != nil || errs[2] != nil {
			t.Fatalf("%d messages sent, deliveries %v; want 2: the first's answer lost, the second sent again", n, errs)
		}
	})
	t.Run("AtMostOnce", func(t *testing.T) {
		a := twilioAPI(1)
		rt, _ := idemhttp.NewTransport(redirectTo(t, serve(t, a)), &idemhttp.TransportConfig{AllowUnkeyed: true})
		errs := notify(twilioClient(rt), "order-3", idem.AtMostOnce())
		if n, _ := a.counts(); n != 1 {
			t.Fatalf("%d messages sent; want 1", n)
		}
		for i, err := range errs {
			if err == nil || i > 0 && !errors.Is(err, idem.ErrFailed) {
				t.Fatalf("delivery %d: %v, want the event failed for good", i+1, err)
			}
		}
	})
}
