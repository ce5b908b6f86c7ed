package inbox

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemhttp"
)

// AcceptDelivery implements idemhttp.Acceptor: idemhttp's asynchronous
// mode (idemhttp.Config.Async) hands it each verified delivery.
func (in *Inbox) AcceptDelivery(ctx context.Context, d *idemhttp.Delivery) (bool, error) {
	a, err := in.Accept(ctx, &Delivery{Source: d.Source, Key: d.Key, EventType: d.EventType,
		Fingerprint: d.Fingerprint, Payload: d.Body, Header: d.Header, AcceptedAt: time.Now(), TTL: d.TTL, Lease: d.Lease,
		GuardSource: d.GuardSource, GuardKey: d.GuardKey, Method: d.Method, Target: d.Target, Host: d.Host, Pattern: d.Pattern,
		Principal: d.Principal})
	return a.Duplicate, err
}

// FromHTTP runs an http.Handler as the inbox's Handler: the delivery is
// replayed to it as the request it arrived as: its method (a delivery
// kept before the method was, without one, as POST), at its request
// target (path and query) and host, with its payload and kept headers,
// and, when an http.ServeMux pattern routed it, through that pattern, so
// that r.PathValue and r.Pattern are what the router gave the original
// request (other routers' route values are not kept); with the delivery's
// context (its claim: idem.Client.Effect works inside) carrying the
// principal idemhttp's Config.Scope named (idemhttp.Principal). A 2xx
// answer completes the event, storing its status; any other answer is an
// error, retried with backoff. So the handler a synchronous idemhttp
// middleware ran can run behind the inbox unchanged, as long as it reads
// its principal with idemhttp.Principal (the application's
// authentication does not run in the worker). It does not use tx: the
// handler's writes commit on their own, as they did behind idemhttp.
func FromHTTP(h http.Handler) Handler {
	return func(ctx context.Context, _ pgx.Tx, d *Delivery) (any, error) {
		target := d.Target
		if target == "" {
			target = "/"
		}
		method := d.Method
		if method == "" {
			method = http.MethodPost
		}
		if d.Principal != "" {
			ctx = idemhttp.WithPrincipal(ctx, d.Principal)
		}
		req, err := http.NewRequestWithContext(ctx, method, "/", bytes.NewReader(d.Payload))
		if err != nil {
			return nil, idem.Permanent(fmt.Errorf("inbox: the delivery's method %q: %w", method, err))
		}
		// Parsed as the server parsed it (a path starting with "//" is a
		// path, not a host).
		if req.URL, err = url.ParseRequestURI(target); err != nil {
			return nil, idem.Permanent(fmt.Errorf("inbox: the delivery's request target %q: %w", target, err))
		}
		req.RequestURI = target
		if d.Host != "" {
			req.Host = d.Host
		}
		for k, v := range d.Header {
			req.Header[k] = v
		}
		rec := &response{header: http.Header{}}
		route(h, d.Pattern).ServeHTTP(rec, req)
		status := rec.status
		if status == 0 {
			status = http.StatusOK
		}
		if status/100 != 2 {
			err := fmt.Errorf("inbox: the handler answered %d: %s", status, bytes.TrimSpace(rec.body.Bytes()))
			if idemhttp.Momentary(status) {
				// As in synchronous mode: about the moment, not the event
				// (429, 503, ...): never counted as an attempt.
				return nil, idem.Momentary(err)
			}
			return nil, err
		}
		return map[string]int{"status": status}, nil
	}
}

// route returns h behind an http.ServeMux with pattern, which sets the
// request's Pattern and path values as the application's mux did, and "/"
// for a request the pattern no longer matches (h itself when there is no
// pattern, or one ServeMux does not take).
func route(h http.Handler, pattern string) (r http.Handler) {
	if pattern == "" || pattern == "/" {
		return h
	}
	defer func() {
		if recover() != nil { // ServeMux panics on a pattern it does not take
			r = h
		}
	}()
	mux := http.NewServeMux()
	mux.Handle(pattern, h)
	mux.Handle("/", h)
	return mux
}

// response records a handler's status and the start of its body.
type response struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (r *response) Header() http.Header { return r.header }
func (r *response) WriteHeader(s int) {
	if r.status == 0 {
		r.status = s
	}
}
func (r *response) Write(b []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	if room := 4096 - r.body.Len(); room > 0 {
		r.body.Write(b[:min(len(b), room)])
	}
	return len(b), nil
}
