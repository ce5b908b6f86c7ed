package outboundsdk_test

import (
	"context"
	"errors"
	"net/http"
	"testing"

	"github.com/sendgrid/rest"
	"github.com/sendgrid/sendgrid-go"
	"github.com/sendgrid/sendgrid-go/helpers/mail"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/internal/testdb"
)

// sendgridAPI is a stand-in for SendGrid's v3 mail send, which takes no
// idempotency key: every request sends the email.
func sendgridAPI(lose int) *api {
	return &api{lose: lose, answer: func(w http.ResponseWriter, id, _ string) {
		w.Header().Set("X-Message-Id", id)
		w.WriteHeader(http.StatusAccepted)
	}}
}

// sendReceipt sends one email through sendgrid-go over rt: the request
// sendgrid.GetRequest builds, sent by a rest.Client of our own (the
// package's DefaultClient is a global) with the caller's context
// (SendWithContext; Send, like sendgrid.API and Client.Send, uses
// context.Background()).
func sendReceipt(ctx context.Context, url string, rt http.RoundTripper, withContext bool) (string, error) {
	req := sendgrid.GetRequest("SG.test", "/v3/mail/send", url)
	req.Method = rest.Post
	req.Body = mail.GetRequestBody(mail.NewV3MailInit(mail.NewEmail("Shop", "shop@example.com"), "Your receipt",
		mail.NewEmail("Ann", "ann@example.com"), mail.NewContent("text/plain", "Thank you for order 1.")))
	rc := &rest.Client{HTTPClient: &http.Client{Transport: rt}}
	var res *rest.Response
	var err error
	if withContext {
		res, err = rc.SendWithContext(ctx, req)
	} else {
		res, err = rc.Send(req)
	}
	if err != nil {
		return "", err
	}
	return http.Header(res.Headers).Get("X-Message-Id"), nil
}

// TestOutboundSendGrid: sendgrid-go passes the caller's context on
// (SendWithContext), so its writes are inside the effect; but SendGrid's
// mail send takes no key (the Transport's header is ignored), so a lost
// answer sends the email again on the effect's next attempt: two emails
// by default. An AtMostOnce effect sends one, and is failed for good when
// its answer is lost. A send without the context (Send) is refused as
// outside an effect.
func TestOutboundSendGrid(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := testdb.Client(t, testdb.Pool(t, testdb.New(t), 4), nil)
	rt, err := idemhttp.NewTransport(nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	receipt := func(url, order string, withContext bool, opts ...idem.EffectOption) (errs []error) {
		for range 3 { // the event's deliveries
			_, err := c.Do(ctx, "shop", order, func(ctx context.Context) (any, error) {
				return idem.EffectValue(ctx, c, "receipt", func(ctx context.Context) (string, error) {
					return sendReceipt(ctx, url, rt, withContext)
				}, opts...)
			})
			errs = append(errs, err)
		}
		return errs
	}
	t.Run("without the context", func(t *testing.T) {
		a := sendgridAPI(0)
		errs := receipt(serve(t, a).URL, "order-1", false)
		if n, _ := a.counts(); n != 0 || !errors.Is(errs[0], idemhttp.ErrNoEffect) {
			t.Fatalf("%d emails, first delivery %v; want none, ErrNoEffect", n, errs[0])
		}
	})
	t.Run("at least once by default", func(t *testing.T) {
		a := sendgridAPI(1)
		errs := receipt(serve(t, a).URL, "order-2", true)
		if n, _ := a.counts(); n != 2 || errs[0] == nil || errs[1] != nil || errs[2] != nil {
			t.Fatalf("%d emails, deliveries %v; want 2: the first's answer lost, the second sent again", n, errs)
		}
	})
	t.Run("AtMostOnce", func(t *testing.T) {
		a := sendgridAPI(1)
		errs := receipt(serve(t, a).URL, "order-3", true, idem.AtMostOnce())
		if n, _ := a.counts(); n != 1 || !errors.Is(errs[1], idem.ErrFailed) || !errors.Is(errs[2], idem.ErrFailed) {
			t.Fatalf("%d emails, deliveries %v; want 1, the event failed for good", n, errs)
		}
	})
	t.Run("AtMostOnce, answered", func(t *testing.T) {
		a := sendgridAPI(0)
		errs := receipt(serve(t, a).URL, "order-4", true, idem.AtMostOnce())
		if n, _ := a.counts(); n != 1 || errs[0] != nil || errs[1] != nil || errs[2] != nil {
			t.Fatalf("%d emails, deliveries %v; want 1, every delivery answered", n, errs)
		}
	})
}
