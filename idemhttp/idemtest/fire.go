package idemtest

import (
	"context"
	"io"
	"net/http"
	"sync"
	"testing"
	"time"
)

// Client is the HTTP client Fire uses: a real one, with a timeout like a
// sender's (Stripe and GitHub give up after about 10 s; tests allow 30).
var Client = &http.Client{Timeout: 30 * time.Second}

// Fire sends n copies of d to url at once, each on a connection of its
// own, and returns their status codes in no particular order. A copy that
// gets no answer fails t. Send different deliveries (Redeliver, Resend)
// with FireAll.
func Fire(t testing.TB, url string, d *Delivery, n int) []int {
	t.Helper()
	ds := make([]*Delivery, n)
	for i := range ds {
		ds[i] = d
	}
	return FireAll(t, url, ds...)
}

// FireAll sends every delivery to url at once and returns the status codes
// in the order of ds.
func FireAll(t testing.TB, url string, ds ...*Delivery) []int {
	t.Helper()
	codes := make([]int, len(ds))
	errs := make([]error, len(ds))
	var start, wg sync.WaitGroup
	start.Add(1)
	for i, d := range ds {
		wg.Go(func() {
			req, err := d.Request(context.Background(), url)
			if err != nil {
				errs[i] = err
				return
			}
			req.Close = true // a connection each: a real race, not one keep-alive connection taking turns
			start.Wait()
			resp, err := Client.Do(req)
			if err != nil {
				errs[i] = err
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			codes[i] = resp.StatusCode
		})
	}
	start.Done()
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("idemtest: delivery %d of %d got no answer: %v", i+1, len(ds), err)
		}
	}
	return codes
}

// Send sends d once and returns the response, its body read into Body
// (closed already; read it from the returned bytes).
func Send(t testing.TB, url string, d *Delivery) (*http.Response, []byte) {
	t.Helper()
	req, err := d.Request(context.Background(), url)
	if err != nil {
		t.Fatalf("idemtest: %v", err)
	}
	resp, err := Client.Do(req)
	if err != nil {
		t.Fatalf("idemtest: %s delivery %s got no answer: %v", d.Sender, d.ID, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("idemtest: %s delivery %s: reading the answer: %v", d.Sender, d.ID, err)
	}
	return resp, b
}
