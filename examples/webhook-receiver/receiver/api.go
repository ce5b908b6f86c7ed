package receiver

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/idemkit/idem/idemhttp"
)

// API calls the payment provider and the mail API. Its client sends every
// write through idemhttp.Transport: inside an idem effect it carries the
// effect's Idempotency-Key, the same on every attempt of that effect, and
// outside one it is refused (idemhttp.ErrNoEffect) instead of being sent
// unkeyed.
type API struct {
	HTTP                 *http.Client
	PaymentsURL, MailURL string
}

// NewAPI returns an API whose client keys its writes.
func NewAPI(paymentsURL, mailURL string) (*API, error) {
	rt, err := idemhttp.NewTransport(http.DefaultTransport, nil)
	if err != nil {
		return nil, err
	}
	return &API{HTTP: &http.Client{Transport: rt, Timeout: 10 * time.Second}, PaymentsURL: paymentsURL, MailURL: mailURL}, nil
}

// Charge charges cents to the customer at the payment provider, for the
// invoice, and returns the charge id.
func (a *API) Charge(ctx context.Context, customer string, cents int, invoice string) (string, error) {
	return a.post(ctx, a.PaymentsURL+"/v1/charges", ChargeRequest{Customer: customer, AmountCents: cents, Invoice: invoice})
}

// SendEmail sends an email through the mail API and returns its id.
func (a *API) SendEmail(ctx context.Context, to, subject, invoice string) (string, error) {
	return a.post(ctx, a.MailURL+"/v1/emails", EmailRequest{To: to, Subject: subject, Invoice: invoice})
}

// ChargeRequest is the body of POST /v1/charges.
type ChargeRequest struct {
	Customer    string `json:"customer"`
	AmountCents int    `json:"amount"`
	Invoice     string `json:"invoice"`
}

// EmailRequest is the body of POST /v1/emails.
type EmailRequest struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
	Invoice string `json:"invoice"`
}

func (a *API) post(ctx context.Context, url string, body any) (string, error) {
	b, err := json.Marshal(body)
	if err != nil {
		return "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := a.HTTP.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 1<<16))
	if err != nil {
		return "", err
	}
	if resp.StatusCode/100 != 2 {
		return "", fmt.Errorf("POST %s: %s: %s", url, resp.Status, bytes.TrimSpace(raw))
	}
	var out struct {
		ID string `json:"id"`
	}
	if err := json.Unmarshal(raw, &out); err != nil || out.ID == "" {
		return "", fmt.Errorf("POST %s: unexpected answer %q", url, raw)
	}
	return out.ID, nil
}
