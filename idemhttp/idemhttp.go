// Package idemhttp is net/http middleware that makes webhook and API
// handlers idempotent with idem: the first request with a key runs the
// handler, its response is stored, and every later request with the same
// key gets that response replayed (with Idempotency-Replayed: true).
//
// Responses follow the IETF Idempotency-Key draft, as RFC 9457
// problem+json: a missing key is 400 (or passed through), a request while
// the first is still in flight is 409 with Retry-After, the same key with a
// different payload is 422, an oversized request body is 413. A handler
// that answers 5xx or panics releases the key, so the sender's retry runs
// it again; so does any non-2xx answer under a webhook preset, and 401,
// 403, 408, 409, 425 and 429 in the IETF mode, whose keys are scoped per
// principal (Config.Scope). The presets verify the sender's signature before
// anything is claimed (Config.Verify). The handler runs
// detached from the request's context, under Config.HandlerTimeout: a
// sender that times out and hangs up neither cancels the work nor keeps
// its answer from being recorded.
//
// Presets verify and extract the key the way real senders sign and send
// it: Stripe (event id in the body), GitHub (X-GitHub-Delivery), Shopify
// (X-Shopify-Event-Id), Standard Webhooks / Svix (webhook-id or svix-id,
// whichever the signature covers), and nineteen more: Twilio, Slack,
// Square, Paddle, SendGrid, HubSpot, GitLab, Linear, Zoom, PagerDuty,
// Discord, Twitch, Typeform, Intercom, WooCommerce, Bitbucket, Adyen,
// Mailgun and Calendly, with
// their handshakes (answered by the preset), URL-covering signatures
// (PublicURL) and multi-event deliveries (a key per event);
// docs/senders.md says, per sender, what the signature proves and where
// each decision comes from. It is plain
// net/http, so it wraps chi, echo and gin handlers through their net/http
// adapters.
package idemhttp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// Defaults.
const (
	DefaultMaxRequestBody  = 1 << 20   // 1 MiB
	DefaultMaxResponseBody = 512 << 10 // 512 KiB: stored base64 inside idem's 1 MiB result cap
	DefaultHandlerTimeout  = time.Minute
	// MaxResponseBodyLimit is the largest MaxResponseBody: a body this
	// long, base64 in the stored answer, leaves 64 KiB of idem's stored
	// result (idem.MaxResultBytes) to the status and headers. 720 KiB.
	MaxResponseBodyLimit = (idem.MaxResultBytes - 64<<10) / 4 * 3
)

// ErrInvalidConfig: New refused a Config; the error says which field and
// why.
var ErrInvalidConfig = errors.New("idemhttp: invalid Config")

// KeyFunc extracts the idempotency key (and, optionally, the event type)
// from a request whose body has been read into body. An empty key means the
// request has none.
type KeyFunc func(r *http.Request, body []byte) (key, eventType string, err error)

// FingerprintFunc summarizes the request; the same key with a different
// fingerprint is answered 422. An empty fingerprint is none: the key alone
// is the request's identity (NoFingerprint).
type FingerprintFunc func(r *http.Request, body []byte) string

// Config configures the middleware. Client and Source are required.
type Config struct {
	// Client runs the protocol (over a pool: the middleware heartbeats the
	// lease while a slow handler runs).
	Client *idem.Client
	// Source is the namespace of the keys, e.g. "stripe"; presets set it
	// when it is empty. Give each endpoint its own: New refuses a second
	// middleware over the same Client whose source is taken by another
	// endpoint (ErrSourceInUse).
	Source string
	// Key extracts the key. Default: the Idempotency-Key header.
	Key KeyFunc
	// Fingerprint summarizes the request. Default: SHA-256 of method, path
	// and body; the webhook presets set their own (docs/senders.md).
	Fingerprint FingerprintFunc
	// PassThroughMissingKey runs the handler without idempotency when a
	// request has no key, instead of answering 400.
	PassThroughMissingKey bool
	// MaxRequestBody caps the request body (413 past it). Default 1 MiB.
	MaxRequestBody int64
	// MaxResponseBody caps the stored response body, and what of an
	// answer is held in memory. An answer up to it is sent once the
	// handler returns (or as it flushes), and stored whole. A larger one
	// streams to the client as the handler writes it and is stored
	// without its body (status and replay headers only,
	// Response.BodyOmitted): the handler ran, so a duplicate is answered
	// with that status instead of running it again. Default 512 KiB; at
	// most MaxResponseBodyLimit (New refuses more: ErrInvalidConfig), so
	// that the stored answer fits idem's stored result.
	MaxResponseBody int
	// ReplayHeaders are the response headers stored and replayed.
	// Default: Content-Type, Content-Language, Location, Cache-Control, ETag.
	// Whatever it says, the headers the body's bytes are read by
	// (Content-Type, Content-Encoding, Content-Language,
	// Content-Location, Content-Range and Vary) are stored and replayed
	// too: a gzip-encoded answer replays with its Content-Encoding, as
	// the client first read it.
	ReplayHeaders []string
	// Verify checks the delivery's signature before anything is claimed
	// (presets set it from their secrets). A delivery that fails is
	// answered 400 (ErrSignatureMissing) or 401 problem+json, and nothing
	// is claimed or stored, so a forged delivery can never poison the key
	// of the genuine one.
	Verify Verifier
	// VerifiedUpstream says that deliveries are verified before they reach
	// this middleware (an API gateway, another middleware). A webhook
	// preset without secrets refuses to start without it.
	VerifiedUpstream bool
	// Store decides which statuses are stored and replayed; the others
	// release the key, so the next request runs the handler again.
	// Default for the webhook presets: 2xx only (a sender retries anything
	// else, and a 4xx may be transient: a secret being fixed, an event that
	// arrived before the object it refers to). Default otherwise (IETF
	// Idempotency-Key): every status below 500 except 401, 403, 408, 409,
	// 425 and 429, which describe the moment, not the request.
	Store func(status int) bool
	// Scope names the principal a key belongs to: what the application's
	// authentication decided the client is (a user, tenant or API client
	// id), never a credential's bytes, so that a client that refreshes its
	// token, or signs each request anew, is the same client. The key is
	// stored as idem.ScopeKey(principal, key): the same key from two
	// principals is two keys, and one principal's stored answer never
	// reaches another. An error answers 401 problem+json and claims
	// nothing (a request whose principal is unknown); "" is no principal:
	// idem.ScopeKey("", key) ("|" and the key), a space shared by every
	// request without one and never met by any principal's keys, whatever
	// bytes a key holds. Unscoped itself keeps keys as they are (no
	// request of its endpoint has a principal). The handler reads the
	// principal with Principal(r.Context()), in both modes.
	//
	// Required with the default Key (the Idempotency-Key header, chosen
	// by each client): New refuses a Config without it (ErrScopeRequired);
	// set Unscoped where the keys are the endpoint's own (one client, or
	// keys unique by construction). Keys taken from a payload or a
	// sender's header (a preset, JSONKey, HeaderKey, Compose) identify the
	// event whoever sends it, and are scoped only when Scope is set.
	Scope func(r *http.Request) (principal string, err error)
	// TTL and Lease override the source's policy (0: the policy). Senders
	// time out after about 10 seconds (Stripe, GitHub): the lease is
	// extended while the handler runs, so it only needs to outlast a
	// crashed worker's silence.
	TTL, Lease time.Duration
	// OnReplay, when set, is called for every answer the middleware
	// replays instead of running the handler (a stored answer, a copy of a
	// signed body under another delivery id, a delivery accepted before),
	// just before it is written: it may add headers to h (every replayed
	// answer already carries Idempotency-Replayed: true, the webhook
	// presets' included), log or count it. The status and body are the
	// stored ones. Default: none.
	OnReplay func(r *http.Request, h http.Header, rp Replay)
	// Wait, when set, makes a duplicate that arrives while the first
	// request is still running wait up to Wait for the first one's answer
	// and replay it (or run the handler itself, if the first one failed
	// and released the key), instead of answering 409 at once; past Wait
	// it answers 409 as without it. Synchronous mode only (asynchronous
	// mode answers every delivery at once). See idem.WithWait: notified
	// through LISTEN/NOTIFY, polling behind a transaction pooler. Default
	// (0): no waiting; at most idem.MaxWait.
	Wait time.Duration
	// HandlerTimeout is the server's own deadline for the handler. The
	// handler's context is detached from the request's: a sender that
	// times out and hangs up does not cancel work that has started, and
	// its answer is still recorded, so the sender's retry is answered from
	// it instead of running the work again. It runs from the claim on, so
	// the claim's round trip counts against it. Default (0) 1 minute.
	HandlerTimeout time.Duration
	// Logger receives warnings. Default slog.Default().
	Logger *slog.Logger
	// Observer is told how every request was answered, for metrics
	// (package idemprom). Claims are observed by the Client's own
	// Config.Observer. Default: none.
	Observer Observer

	// Async, when set, answers first and processes later: once the
	// delivery is verified and keyed, it is handed to Async (package
	// inbox: the key claimed and a River job inserted in one transaction)
	// and answered 202 Accepted at once, as is every duplicate of an
	// accepted delivery; the wrapped handler is not called (the inbox's
	// worker runs the processing). A key reused with another payload is
	// 422; a failure to accept is 503, so the sender retries. Usually set
	// by inbox.Inbox.HTTP, which also has the inbox's worker run the
	// wrapped handler. See docs/inbox.md.
	Async Acceptor
	// KeepHeaders names request headers, besides Content-Type, User-Agent
	// and the sender's own event, delivery and signature headers (a
	// preset's), that asynchronous mode keeps with the delivery: stored
	// with its job and handed to the worker's handler. Every other header
	// is dropped before anything is stored: credentials (Authorization,
	// cookies, X-Api-Key and any vendor token) never reach the database.
	// Default: none.
	KeepHeaders []string

	sender        string   // set by a webhook preset: its name
	senderHeaders []string // a preset's event, delivery and signature headers
	guardBody     bool     // the replay guard (guard.go): the signature covers the body only and the sender never sends one body as two events
	presetErr     error    // a preset's bad secret
	secrets       []string // a preset's signing secrets: the endpoint's identity (endpoint.go)
	defaultSource bool     // Source is the preset's default, not named by the caller
	// legacyFingerprint is the fingerprint an earlier version stored for
	// the preset's keys (GitHub, Shopify: the body alone), tried on a
	// mismatch in synchronous mode.
	legacyFingerprint FingerprintFunc
	// handshake answers a verified delivery that is the sender's
	// handshake, not an event (handshake.go); batch makes every event of a
	// multi-event delivery its own key (batch.go).
	handshake handshakeFunc
	batch     *batchSpec
	// ping answers a request that is the sender's unsigned ping, not a
	// delivery (WooCommerce's activation ping), before verification:
	// nothing is claimed, stored or run (handshake.go).
	ping handshakeFunc
}

// Response is what the middleware stores for a key: enough to replay the
// first answer byte for byte.
type Response struct {
	Status  int                 `json:"status"`
	Headers map[string][]string `json:"headers,omitempty"`
	Body    []byte              `json:"body"` // base64 in JSON
	// BodyOmitted: the body was over MaxResponseBody (or would not fit
	// idem's stored result) and was not stored; a replay sends the status
	// and headers with an empty body.
	BodyOmitted bool `json:"body_omitted,omitempty"`
	// HeadersOmitted: some replay headers were not stored (a value
	// PostgreSQL cannot hold, such as a NUL byte, or headers too large to
	// store); a replay sends the status without them.
	HeadersOmitted bool `json:"headers_omitted,omitempty"`
}

// ReplayedHeader marks a replayed response.
const ReplayedHeader = "Idempotency-Replayed"

// Why an answer is replayed (Replay.Why).
const (
	ReplayStored   = "stored answer"         // the first delivery's stored answer
	ReplayCopy     = "copy of a signed body" // the replay guard: the body came before under another delivery id
	ReplayAccepted = "accepted before"       // asynchronous mode: the delivery is already accepted
)

// Replay describes a replayed answer, for Config.OnReplay.
type Replay struct {
	Source, Key string
	Status      int    // the status about to be sent
	Why         string // ReplayStored, ReplayCopy or ReplayAccepted
}

// replayed marks the answer about to be written as replayed and calls
// Config.OnReplay.
func (m *middleware) replayed(w http.ResponseWriter, r *http.Request, key string, status int, why string) {
	w.Header().Set(ReplayedHeader, "true")
	m.decided(r, key, DecisionReplayed, why)
	if m.cfg.OnReplay != nil {
		m.cfg.OnReplay(r, w.Header(), Replay{Source: m.cfg.Source, Key: key, Status: status, Why: why})
	}
}

// Store2xx stores only 2xx answers: the webhook presets' default.
func Store2xx(status int) bool { return status >= 200 && status < 300 }

// StoreIETF stores every answer below 500 except 401, 403, 408, 409, 425
// and 429: the IETF Idempotency-Key mode's default.
func StoreIETF(status int) bool {
	return !Momentary(status) && status < 500
}

// Momentary reports a status that describes the moment, not the request:
// 401, 403, 408, 409, 425, 429 and 503. Such an answer that Config.Store
// does not keep (none of them, under either default) releases the key
// without counting as an attempt toward the source's max_attempts
// (idem.Momentary): a client rate-limited 25 times still gets its request
// run once the limit lifts.
func Momentary(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusRequestTimeout,
		http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests,
		http.StatusServiceUnavailable:
		return true
	}
	return false
}

// New returns the middleware, or an error for an invalid Config: among
// others a preset's bad secret (ErrInvalidSecret), a source taken by
// another endpoint over the same Client (ErrSourceInUse), the default
// Idempotency-Key header without Config.Scope (ErrScopeRequired), and a
// MaxResponseBody over MaxResponseBodyLimit (ErrInvalidConfig).
func New(cfg Config) (func(http.Handler) http.Handler, error) {
	if cfg.Client == nil {
		return nil, fmt.Errorf("%w: Config.Client is required", ErrInvalidConfig)
	}
	if cfg.Source == "" {
		return nil, fmt.Errorf("%w: Config.Source is required", ErrInvalidConfig)
	}
	if cfg.presetErr != nil {
		return nil, cfg.presetErr
	}
	if cfg.sender != "" && cfg.Verify == nil && !cfg.VerifiedUpstream {
		return nil, fmt.Errorf("idemhttp: the %s preset has no signing secret: pass the endpoint's secret (idemhttp.%s(secret)), "+
			"or set Config.VerifiedUpstream if deliveries are verified before this middleware", cfg.sender, cfg.sender)
	}
	if cfg.Key == nil {
		if cfg.Scope == nil && cfg.sender == "" {
			return nil, ErrScopeRequired
		}
		cfg.Key = IdempotencyKeyHeader
	}
	if cfg.Fingerprint == nil {
		cfg.Fingerprint = RequestFingerprint
	}
	if cfg.MaxRequestBody == 0 {
		cfg.MaxRequestBody = DefaultMaxRequestBody
	}
	if cfg.MaxResponseBody == 0 {
		cfg.MaxResponseBody = DefaultMaxResponseBody
	}
	if cfg.MaxRequestBody < 0 || cfg.MaxResponseBody < 0 {
		return nil, fmt.Errorf("%w: body caps must not be negative", ErrInvalidConfig)
	}
	if cfg.MaxResponseBody > MaxResponseBodyLimit {
		return nil, fmt.Errorf("%w: MaxResponseBody %d is over MaxResponseBodyLimit (%d): its answer, base64 in the stored result, "+
			"would not fit idem's %d bytes; larger answers are sent whole and stored without their body anyway",
			ErrInvalidConfig, cfg.MaxResponseBody, MaxResponseBodyLimit, idem.MaxResultBytes)
	}
	if cfg.TTL < 0 || cfg.Lease < 0 {
		return nil, fmt.Errorf("%w: TTL %v and Lease %v must not be negative (0: the source's policy)", ErrInvalidConfig, cfg.TTL, cfg.Lease)
	}
	if cfg.Wait < 0 || cfg.Wait > idem.MaxWait {
		return nil, fmt.Errorf("%w: Wait %v must be between 0 (no waiting) and %v", ErrInvalidConfig, cfg.Wait, idem.MaxWait)
	}
	if cfg.HandlerTimeout < 0 {
		return nil, fmt.Errorf("%w: HandlerTimeout %v must not be negative (0: the default %v)", ErrInvalidConfig, cfg.HandlerTimeout, DefaultHandlerTimeout)
	}
	if cfg.HandlerTimeout == 0 {
		cfg.HandlerTimeout = DefaultHandlerTimeout
	}
	if cfg.ReplayHeaders == nil {
		cfg.ReplayHeaders = []string{"Content-Type", "Content-Language", "Location", "Cache-Control", "ETag"}
	}
	cfg.ReplayHeaders = withRepresentation(cfg.ReplayHeaders)
	if cfg.Store == nil {
		cfg.Store = StoreIETF
		if cfg.sender != "" {
			cfg.Store = Store2xx
		}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.batch != nil && cfg.Async != nil {
		return nil, fmt.Errorf("idemhttp: the %s preset deduplicates each event of a delivery and runs the handler synchronously; Config.Async is not supported with it", cfg.sender)
	}
	if err := claimSource(&cfg); err != nil {
		return nil, err
	}
	return func(next http.Handler) http.Handler {
		return &middleware{cfg: cfg, next: next, unscoped: isUnscoped(cfg.Scope), unscopedWarning: new(sync.Once)}
	}, nil
}

type middleware struct {
	cfg             Config
	next            http.Handler
	unscoped        bool       // Config.Scope is Unscoped: keys as they are
	unscopedWarning *sync.Once // warnUnscoped
}

// errRetry marks a handler answer that is not stored: the key is released.
type errRetry struct{ status int }

func (e errRetry) Error() string { return fmt.Sprintf("handler answered %d", e.status) }

// errHandlerTimeout: the handler returned on HandlerTimeout's cancelled
// context without answering. The key is released; the client is told to
// retry.
var errHandlerTimeout = errors.New("idemhttp: the handler returned without an answer when HandlerTimeout ended")

func (m *middleware) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a := m.serve(w, r)
	m.decided(r, "", DecisionAnswered, string(a))
	if m.cfg.Observer != nil {
		m.cfg.Observer.ObserveAnswer(m.cfg.Source, a)
	}
}

// legacyFingerprints are the fingerprints earlier versions stored for
// this delivery, other than fp: a preset's (Config.legacyFingerprint),
// and the form the Fingerprint func gives when asked for its legacy one
// (legacyFingerprint: JSONFingerprint's numbers as written,
// RequestFingerprint without the query string).
func (m *middleware) legacyFingerprints(r *http.Request, body []byte, fp string) []string {
	var olds []string
	if m.cfg.legacyFingerprint != nil {
		if old := m.cfg.legacyFingerprint(r, body); old != fp {
			olds = append(olds, old)
		}
	}
	if old := legacyFingerprint(m.cfg.Fingerprint, r, body, fp); old != "" {
		olds = append(olds, old)
	}
	return olds
}

// serve answers r and says how.
func (m *middleware) serve(w http.ResponseWriter, r *http.Request) Answer {
	body, ok := m.readBody(w, r)
	if !ok {
		return AnswerBadRequest
	}
	r.Body = io.NopCloser(newReader(body))
	if m.cfg.ping != nil && m.cfg.ping(w, r, body) {
		return AnswerHandshake
	}
	if !m.verified(w, r, body) {
		return AnswerRefused
	}
	if m.cfg.handshake != nil && m.cfg.handshake(w, r, body) {
		return AnswerHandshake
	}
	if m.cfg.batch != nil {
		return m.serveBatch(w, r, body)
	}
	key, eventType, err := m.cfg.Key(r, body)
	if err != nil {
		m.problem(w, r, problemAnswer{status: http.StatusBadRequest, title: "Invalid idempotency key",
			detail: keyErrorDetail(err), cause: err, level: slog.LevelInfo})
		return AnswerBadRequest
	}
	if key == "" {
		if m.cfg.PassThroughMissingKey {
			m.next.ServeHTTP(w, r)
			return AnswerPassedThrough
		}
		m.problem(w, r, problemAnswer{status: http.StatusBadRequest, title: "Idempotency key missing",
			detail: "This endpoint requires an idempotency key (the Idempotency-Key header, or the sender's delivery id)."})
		return AnswerBadRequest
	}
	rawKey := key
	key, principal, ok := m.scoped(w, r, key)
	if !ok {
		return AnswerRefused
	}
	key = m.legacyKey(r, key, rawKey, principal)
	if principal != "" {
		r = r.WithContext(WithPrincipal(r.Context(), principal))
	}
	if m.cfg.Async != nil {
		d := &Delivery{Source: m.cfg.Source, Key: key, EventType: eventType,
			Fingerprint: m.cfg.Fingerprint(r, body), Body: body, Header: m.keep(r.Header),
			TTL: m.cfg.TTL, Lease: m.cfg.Lease, Method: r.Method, Target: RequestTarget(r), Host: r.Host, Pattern: r.Pattern,
			Principal: principal}
		if m.cfg.guardBody {
			d.GuardSource, d.GuardKey = m.cfg.Source+GuardSuffix, GuardKey(eventType, body)
		}
		return m.accept(w, r, d)
	}
	if m.cfg.guardBody {
		replay, done, err := m.guard(r.Context(), key, eventType, body)
		switch {
		case err != nil:
			m.problem(w, r, problemAnswer{status: http.StatusServiceUnavailable, title: "Idempotency store unavailable",
				detail: "The request was not processed; retry later.", headers: map[string]string{"Retry-After": "5"},
				level: slog.LevelError, msg: "idemhttp: idempotency store failed", key: key, cause: err})
			return AnswerUnavailable
		case replay:
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: a signed body delivered before under another delivery id: answered as a duplicate, nothing run",
				slog.String("source", m.cfg.Source), slog.String("key", key))
			return m.replayedCopy(w, r, key)
		}
		defer done()
	}
	return m.run(w, r, key, eventType, body)
}

// readBody reads the request body under MaxRequestBody (413 past it).
func (m *middleware) readBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxRequestBody))
	if err == nil {
		return body, true
	}
	if tooBig := new(http.MaxBytesError); errors.As(err, &tooBig) {
		m.problem(w, r, problemAnswer{status: http.StatusRequestEntityTooLarge, title: "Request body too large",
			detail: fmt.Sprintf("The request body exceeds %d bytes.", m.cfg.MaxRequestBody)})
		return nil, false
	}
	m.problem(w, r, problemAnswer{status: http.StatusBadRequest, title: "Unreadable request body",
		detail: "The request body could not be read.", cause: err, level: slog.LevelInfo})
	return nil, false
}

// verified checks the delivery's signature (Config.Verify), before
// anything is claimed.
func (m *middleware) verified(w http.ResponseWriter, r *http.Request, body []byte) bool {
	err := m.repeatedHeader(r)
	if err == nil && m.cfg.Verify != nil {
		err = m.cfg.Verify(r, body)
	}
	if err == nil {
		if m.cfg.Verify != nil { // no signature to check out without it (API mode)
			m.decided(r, "", DecisionVerified, "")
		}
		return true
	}
	p := problemAnswer{status: http.StatusUnauthorized, title: "Signature verification failed",
		detail: "The delivery's signature does not verify with this endpoint's secret, or its timestamp is too far from now.",
		level:  slog.LevelWarn, msg: "idemhttp: delivery refused before any claim", cause: err, attrs: refusalAttrs(err)}
	why := RefusedSignatureInvalid
	if errors.Is(err, ErrSignatureMissing) {
		p.status, p.title, p.detail = http.StatusBadRequest, "Signature missing or malformed",
			"The delivery carries no well-formed signature header."
		why = RefusedSignatureMissing
	}
	m.decided(r, "", DecisionRefused, why)
	m.problem(w, r, p)
	return false
}

// repeatedHeader refuses a delivery that carries one of its preset's
// signature, timestamp, id or event headers more than once
// (ErrSignatureMissing: answered 400 before anything is claimed), on
// every preset and whether or not this middleware verifies it
// (VerifiedUpstream): no sender sends one twice, and which value was
// signed, or names the event, is not the receiver's to guess (reading the
// first, as net/http's Header.Get does, lets an intermediary that appends
// a header decide).
func (m *middleware) repeatedHeader(r *http.Request) error {
	for _, name := range m.cfg.senderHeaders {
		if len(r.Header.Values(name)) > 1 {
			return fmt.Errorf("%w: %s: %s is repeated", ErrSignatureMissing, m.cfg.sender, http.CanonicalHeaderKey(name))
		}
	}
	return nil
}

// claimOptions are the options of the key's claim.
func (m *middleware) claimOptions(eventType string) []idem.ClaimOption {
	var opts []idem.ClaimOption
	if eventType != "" {
		opts = append(opts, idem.WithEventType(eventType))
	}
	if m.cfg.TTL > 0 {
		opts = append(opts, idem.WithTTL(m.cfg.TTL))
	}
	if m.cfg.Lease > 0 {
		opts = append(opts, idem.WithLease(m.cfg.Lease))
	}
	if m.cfg.Wait > 0 {
		opts = append(opts, idem.WithWait(m.cfg.Wait))
	}
	return opts
}

// run claims the key, runs the handler when the claim is acquired and
// answers.
func (m *middleware) run(w http.ResponseWriter, r *http.Request, key, eventType string, body []byte) Answer {
	opts := m.claimOptions(eventType)
	// Detached from the request: once the handler starts, the sender
	// hanging up must not cancel it or keep its answer from being recorded.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.HandlerTimeout)
	defer cancel()
	var rec *recorder
	work := func(ctx context.Context) (any, error) {
		rec = newRecorder(w, m.cfg.MaxResponseBody)
		m.next.ServeHTTP(rec, r.WithContext(ctx))
		return m.outcome(ctx, key, rec)
	}
	fp := m.cfg.Fingerprint(r, body)
	do := func(fp string) (*idem.Result, error) {
		if fp == "" {
			return m.cfg.Client.Do(ctx, m.cfg.Source, key, work, opts...)
		}
		return m.cfg.Client.Do(ctx, m.cfg.Source, key, work, append(opts, idem.WithFingerprint(fp))...)
	}
	res, err := do(fp)
	// A key stored by an earlier version under another fingerprint of the
	// same delivery (a sender preset's body-only fingerprint,
	// JSONFingerprint's numbers as written, RequestFingerprint without the
	// query): its sender's retry is not a mismatch.
	for _, old := range m.legacyFingerprints(r, body, fp) {
		if !errors.Is(err, idem.ErrMismatch) {
			break
		}
		res, err = do(old)
	}
	return m.answer(w, r, key, rec, res, err)
}

// outcome decides, once the handler returned, what becomes of the key:
// the answer to store (the key completed), or an error that releases it
// (errRetry: a status Config.Store does not keep, not counted as an
// attempt when Momentary; errHandlerTimeout).
func (m *middleware) outcome(ctx context.Context, key string, rec *recorder) (any, error) {
	if err := m.release(ctx, rec); err != nil {
		return nil, err
	}
	resp, raw := m.stored(rec)
	if resp.BodyOmitted || resp.HeadersOmitted {
		m.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idemhttp: the answer is too large or holds what cannot be stored; stored its status without it",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Int("status", resp.Status),
			slog.Int64("body_bytes", rec.n), slog.Int("limit", m.cfg.MaxResponseBody),
			slog.Bool("body_omitted", resp.BodyOmitted), slog.Bool("headers_omitted", resp.HeadersOmitted))
	}
	return raw, nil
}

// release decides, once the handler returned on ctx, whether its answer
// releases the key: nil when Config.Store keeps it; otherwise the error
// the key is released with: errHandlerTimeout (the handler returned on
// HandlerTimeout without answering), errRetry marked idem.Momentary for a
// Momentary status (released without counting the attempt), errRetry.
// Every path decides it here: one event (outcome) and every event of a
// multi-event delivery (serveBatch).
func (m *middleware) release(ctx context.Context, rec *recorder) error {
	if !rec.written() && errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
		return errHandlerTimeout
	}
	if status := rec.status(); !m.cfg.Store(status) {
		if Momentary(status) {
			return idem.Momentary(errRetry{status})
		}
		return errRetry{status}
	}
	return nil
}

// answer sends the client the answer the claim and the handler decided.
func (m *middleware) answer(w http.ResponseWriter, r *http.Request, key string, rec *recorder, res *idem.Result, err error) Answer {
	ran := rec != nil // the handler ran (this request's claim was acquired)
	switch {
	case err == nil && res.Replayed:
		m.replay(w, r, key, res.Result)
		return AnswerReplayed
	case err == nil:
		rec.flushTo()
		return AnswerRan
	case errors.Is(err, idem.ErrInProgress):
		retry := 1 // by the database's clock, never compared with ours
		if res != nil && res.Claim != nil {
			retry = max(1, int(math.Ceil(res.Claim.LeaseRemaining.Seconds())))
		}
		m.problem(w, r, problemAnswer{status: http.StatusConflict, title: "Request in progress",
			detail:  "A request with this idempotency key is being processed; retry later.",
			headers: map[string]string{"Retry-After": strconv.Itoa(retry)}})
		return AnswerInProgress
	case errors.Is(err, idem.ErrMismatch):
		m.problem(w, r, problemAnswer{status: http.StatusUnprocessableEntity, title: "Idempotency key reused",
			detail: "This idempotency key was used with a different request payload."})
		return AnswerMismatch
	case errors.Is(err, idem.ErrFailed):
		return m.failedPermanently(w, r, key, "Requests with this idempotency key failed too many times; send the request with a new key.", err)
	case ran && errors.Is(err, idem.ErrResultNotStored):
		// Before ErrInvalidInput, which it matches too when the cause is
		// a value PostgreSQL refused: the handler ran and the key is
		// completed without its answer; send this run's answer.
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: the response could not be stored; the key is completed without it",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		rec.flushTo()
		return AnswerRan
	case ran && errors.Is(err, idem.ErrLeaseLost):
		return m.leaseLost(w, r, key, rec, err)
	case ran && errors.Is(err, errHandlerTimeout):
		m.problem(w, r, problemAnswer{status: http.StatusServiceUnavailable, title: "Request timed out",
			detail: "The request was not completed in time; retry it with the same idempotency key.", headers: map[string]string{"Retry-After": "1"},
			level: slog.LevelWarn, msg: "idemhttp: the handler returned without an answer when HandlerTimeout ended; the key was released", key: key, cause: err})
		return AnswerTimedOut
	case ran && errors.As(err, new(errRetry)):
		// The handler answered; its answer was not stored. Send it as is.
		rec.flushTo()
		return AnswerRan
	case ran && errors.As(err, new(*idem.PanicError)):
		return m.panicked(w, r, key, rec, err)
	case !ran && errors.Is(err, idem.ErrInvalidInput):
		m.problem(w, r, problemAnswer{status: http.StatusBadRequest, title: "Invalid idempotency key",
			detail: "The idempotency key is not usable: at most 512 bytes of UTF-8 text without NUL characters.",
			level:  slog.LevelInfo, msg: "idemhttp: the claim refused the key", key: key, cause: err})
		return AnswerBadRequest
	default:
		if ran && rec.written() {
			// The handler ran: its answer is the truth, even if it could
			// not be stored.
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: idempotency store failed after the handler ran; its answer was sent",
				slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
			rec.flushTo()
			return AnswerRan
		}
		m.problem(w, r, problemAnswer{status: http.StatusServiceUnavailable, title: "Idempotency store unavailable",
			detail: "The request was not processed; retry later.", headers: map[string]string{"Retry-After": "5"},
			level: slog.LevelError, msg: "idemhttp: idempotency store failed", key: key, cause: err})
		return AnswerUnavailable
	}
}

// failedPermanently answers a key that failed for good (past the source's
// max_attempts): 422, on every path.
func (m *middleware) failedPermanently(w http.ResponseWriter, r *http.Request, key, detail string, err error) Answer {
	m.problem(w, r, problemAnswer{status: http.StatusUnprocessableEntity, title: "Request failed permanently",
		detail: detail, level: slog.LevelWarn, msg: "idemhttp: the key failed permanently", key: key, cause: err})
	return AnswerFailed
}

// leaseLost answers a run whose lease lapsed while the handler ran and
// another worker took the key over. That run's answer is the one stored.
// This run's answer, if the handler wrote one, is sent as it is; if the
// handler stopped when its context was cancelled, the client is told to
// retry and will get that answer.
func (m *middleware) leaseLost(w http.ResponseWriter, r *http.Request, key string, rec *recorder, err error) Answer {
	if rec.written() {
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: the lease was lost while the handler ran; another worker took the key over",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		rec.flushTo()
		return AnswerLeaseLost
	}
	m.problem(w, r, problemAnswer{status: http.StatusConflict, title: "Request taken over",
		detail:  "This request took too long and another attempt took it over; retry to get its answer.",
		headers: map[string]string{"Retry-After": "1"},
		level:   slog.LevelWarn, msg: "idemhttp: the lease was lost while the handler ran; another worker took the key over", key: key, cause: err})
	return AnswerLeaseLost
}

// panicked answers a handler that panicked: the key is released. An
// answer already streaming to the client is cut off (http.ErrAbortHandler),
// so that it never looks complete.
func (m *middleware) panicked(w http.ResponseWriter, r *http.Request, key string, rec *recorder, err error) Answer {
	if rec.sent {
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: handler panicked while its answer streamed; the key was released and the answer cut off",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		if m.cfg.Observer != nil {
			m.cfg.Observer.ObserveAnswer(m.cfg.Source, AnswerPanicked)
		}
		panic(http.ErrAbortHandler)
	}
	m.problem(w, r, problemAnswer{status: http.StatusInternalServerError, title: "Internal error",
		detail: "The request failed; retry it.",
		level:  slog.LevelError, msg: "idemhttp: handler panicked; the key was released", key: key, cause: err})
	return AnswerPanicked
}

// representationHeaders (Content-Type, Content-Encoding,
// Content-Language, Content-Location, Content-Range, Vary) are the
// response headers every stored answer keeps and every replay sends,
// whatever Config.ReplayHeaders says: the body's bytes mean what they
// mean only with them. Content-Encoding above
// all: an answer compressed by a middleware inside idem, or by an upstream
// behind a reverse proxy, is stored as it was sent (compressed), and a
// replay without it would hand the client gzip bytes as its JSON. The
// body is stored as sent, never decoded, so that the replay is the first
// answer byte for byte (its Content-Length and ETag included); Vary goes
// with it, so that a cache between idem and the client keeps a compressed
// replay from clients that did not ask for it.
var representationHeaders = []string{"Content-Type", "Content-Encoding", "Content-Language", "Content-Location", "Content-Range", "Vary"}

// withRepresentation returns names with every representationHeaders name
// it lacks appended (a new slice: the caller's is not written).
func withRepresentation(names []string) []string {
	out := make([]string, 0, len(names)+len(representationHeaders))
	seen := map[string]bool{}
	for _, n := range append(append([]string(nil), names...), representationHeaders...) {
		if c := http.CanonicalHeaderKey(n); !seen[c] {
			seen[c] = true
			out = append(out, n)
		}
	}
	return out
}

// storedLimit is the largest stored answer's JSON, with 8 bytes per JSON
// value for what jsonb adds to each: under idem.MaxResultBytes.
const storedLimit = idem.MaxResultBytes - 4<<10

// stored is the answer to store for rec, and its JSON: status, the replay
// headers and the body, within what idem can store. A body over
// MaxResponseBody, or that would not fit, is omitted (BodyOmitted), as
// are header values PostgreSQL cannot hold (a NUL byte) and headers that
// would not fit (HeadersOmitted): the status is always stored, so a
// duplicate is answered with the status the handler meant.
func (m *middleware) stored(rec *recorder) (Response, json.RawMessage) {
	resp := Response{Status: rec.status(), Body: rec.body.Bytes(), Headers: map[string][]string{}}
	if rec.overflow {
		resp.Body, resp.BodyOmitted = nil, true
	}
	h := rec.storedHeader()
	values := 0
	for _, name := range m.cfg.ReplayHeaders {
		vs := h.Values(name)
		if len(vs) == 0 {
			continue
		}
		ok := true
		for _, v := range vs {
			if idem.CheckText("header", v) != nil {
				ok = false
			}
		}
		if !ok {
			resp.HeadersOmitted = true
			continue
		}
		resp.Headers[http.CanonicalHeaderKey(name)] = vs
		values += 1 + len(vs)
	}
	raw, _ := json.Marshal(resp) // nothing in it fails to marshal
	if len(raw)+8*(values+8) > storedLimit && !resp.BodyOmitted {
		resp.Body, resp.BodyOmitted = nil, true
		raw, _ = json.Marshal(resp)
	}
	if len(raw)+8*(values+8) > storedLimit {
		resp.Headers, resp.HeadersOmitted = nil, true
		raw, _ = json.Marshal(resp)
	}
	return resp, raw
}

func (m *middleware) replay(w http.ResponseWriter, r *http.Request, key string, raw json.RawMessage) {
	var resp Response
	if err := json.Unmarshal(raw, &resp); err != nil || resp.Status == 0 {
		// Completed by something other than this middleware (idem.complete
		// from SQL, another program): there is no response to replay.
		w.Header().Set("Content-Type", "application/json")
		m.replayed(w, r, key, http.StatusOK, ReplayStored)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(raw)
		return
	}
	for k, v := range resp.Headers {
		w.Header()[k] = v
	}
	m.replayed(w, r, key, resp.Status, ReplayStored)
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
}
