package inbox

import (
	"fmt"
	"net/http"

	"github.com/idemkit/idem/idemhttp"
)

// Handle routes the deliveries of source to h, instead of Config.Handler.
// Register every source before the worker client starts: a job whose
// source has no handler in the process that runs it fails (retried, then
// dead-lettered) with ErrNoHandler. A source can be routed once.
func (in *Inbox) Handle(source string, h Handler) error {
	if source == "" || h == nil {
		return fmt.Errorf("%w: Handle needs a source and a handler", ErrInvalidConfig)
	}
	in.mu.Lock()
	defer in.mu.Unlock()
	if _, dup := in.routes[source]; dup {
		return fmt.Errorf("%w: source %q already has a handler", ErrInvalidConfig, source)
	}
	if in.routes == nil {
		in.routes = map[string]Handler{}
	}
	in.routes[source] = h
	return nil
}

// HTTP is the asynchronous setup in one call: it returns h wrapped in
// idemhttp's middleware (cfg, with Async set to this inbox), which
// verifies each delivery, accepts it and answers 202, and routes cfg's
// source to FromHTTP(h), so a worker of this inbox runs h for it later.
// h is written once, as for synchronous mode:
//
//	in, err := inbox.New(inbox.Config{Pool: pool})
//	stripe, err := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe(secret)), handler)
//	mux.Handle("POST /webhooks/stripe", stripe)
//	workers, err := in.NewWorkerClient(50, nil)
//
// A worker in a process of its own makes the same call (and does not
// serve the handler it returns). cfg.Async must be unset or this inbox.
func (in *Inbox) HTTP(cfg idemhttp.Config, h http.Handler) (http.Handler, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: HTTP needs a handler", ErrInvalidConfig)
	}
	if cfg.Async != nil && cfg.Async != idemhttp.Acceptor(in) {
		return nil, fmt.Errorf("%w: HTTP sets idemhttp.Config.Async to this inbox; it was set to another acceptor", ErrInvalidConfig)
	}
	cfg.Async = in
	mw, err := idemhttp.New(cfg)
	if err != nil {
		return nil, err
	}
	if err := in.Handle(cfg.Source, FromHTTP(h)); err != nil {
		return nil, err
	}
	return mw(h), nil
}

// handlerFor returns source's handler: its own, else Config.Handler.
func (in *Inbox) handlerFor(source string) (Handler, error) {
	in.mu.RLock()
	h, ok := in.routes[source]
	in.mu.RUnlock()
	switch {
	case ok:
		return h, nil
	case in.cfg.Handler != nil:
		return in.cfg.Handler, nil
	}
	return nil, fmt.Errorf("%w for source %q in this process", ErrNoHandler, source)
}

// canWork says whether a worker of this inbox has any handler.
func (in *Inbox) canWork() bool {
	in.mu.RLock()
	defer in.mu.RUnlock()
	return in.cfg.Handler != nil || len(in.routes) > 0
}
