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

// The asynchronous setup has two sides, each explicit:
//
//   - the web side, Middleware: idemhttp's middleware with Async set to
//     this inbox: it verifies each delivery, accepts it and answers 202;
//     it routes nothing;
//   - the worker side, HandleHTTP: a worker of this inbox runs the
//     source's http.Handler for each accepted delivery (FromHTTP).
//
// A process that does both (the common case) calls HTTP, which is the two
// in one call. A worker-only process calls HandleHTTP alone and builds no
// HTTP handler; a web-only process calls Middleware alone and runs no
// worker.

// Middleware is the web side of the asynchronous setup: idemhttp's
// middleware (cfg, with Async set to this inbox), which verifies each
// delivery, accepts it and answers 202. It routes nothing: the handler it
// wraps runs only for what cfg passes through (PassThroughMissingKey);
// the worker runs the source's handler registered with HandleHTTP (or
// Handle, or Config.Handler). cfg.Async must be unset or this inbox.
func (in *Inbox) Middleware(cfg idemhttp.Config) (func(http.Handler) http.Handler, error) {
	if cfg.Async != nil && cfg.Async != idemhttp.Acceptor(in) {
		return nil, fmt.Errorf("%w: the inbox sets idemhttp.Config.Async to itself; it was set to another acceptor", ErrInvalidConfig)
	}
	cfg.Async = in
	return idemhttp.New(cfg)
}

// HandleHTTP is the worker side of the asynchronous setup: a worker of
// this inbox runs h for each accepted delivery of source (FromHTTP(h):
// the delivery replayed as the request it arrived as). source is the
// idemhttp.Config's Source (a preset's: "stripe", "github", ...). A
// worker-only process needs nothing else:
//
//	in, err := inbox.New(inbox.Config{Pool: pool})
//	err = in.HandleHTTP("stripe", handler)
//	workers, err := in.NewWorkerClient(0, nil) // as many handlers as the pool serves
func (in *Inbox) HandleHTTP(source string, h http.Handler) error {
	if h == nil {
		return fmt.Errorf("%w: HandleHTTP needs a handler", ErrInvalidConfig)
	}
	return in.Handle(source, FromHTTP(h))
}

// HTTP is both sides of the asynchronous setup in one call, for a process
// that serves the webhook and runs the worker: Middleware(cfg)(h), and
// HandleHTTP(cfg.Source, h), so a worker of this inbox runs h later. h is
// written once, as for synchronous mode:
//
//	in, err := inbox.New(inbox.Config{Pool: pool})
//	stripe, err := in.HTTP(idemhttp.Config{Client: c}.Apply(idemhttp.Stripe(secret)), handler)
//	mux.Handle("POST /webhooks/stripe", stripe)
//	workers, err := in.NewWorkerClient(0, nil)
//
// Separate web and worker processes call Middleware and HandleHTTP
// instead. cfg.Async must be unset or this inbox.
func (in *Inbox) HTTP(cfg idemhttp.Config, h http.Handler) (http.Handler, error) {
	if h == nil {
		return nil, fmt.Errorf("%w: HTTP needs a handler", ErrInvalidConfig)
	}
	mw, err := in.Middleware(cfg)
	if err != nil {
		return nil, err
	}
	if err := in.HandleHTTP(cfg.Source, h); err != nil {
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
