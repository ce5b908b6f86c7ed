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
// client (Config.Scope). The presets verify the sender's signature before
// anything is claimed (Config.Verify). The handler runs
// detached from the request's context, under Config.HandlerTimeout: a
// sender that times out and hangs up neither cancels the work nor keeps
// its answer from being recorded.
//
// Presets verify and extract the key the way real senders sign and send
// it: Stripe (event id in the body), GitHub (X-GitHub-Delivery), Shopify
// (X-Shopify-Event-Id), Standard Webhooks / Svix (webhook-id or svix-id,
// whichever the signature covers), and seventeen more: Twilio, Slack,
// Square, Paddle, SendGrid, HubSpot, GitLab, Linear, Zoom, PagerDuty,
// Discord, Twitch, Typeform, Intercom, WooCommerce, Bitbucket and Adyen, with
// their handshakes (answered by the preset), URL-covering signatures
// (PublicURL) and multi-event deliveries (a key per event);
// docs/senders.md says, per sender, what the signature proves and where
// each decision comes from. It is plain
// net/http, so it wraps chi, echo and gin handlers through their net/http
// adapters.
package idemhttp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// Defaults.
const (
	DefaultMaxRequestBody  = 1 << 20   // 1 MiB
	DefaultMaxResponseBody = 512 << 10 // 512 KiB: stored base64 inside idem's 1 MiB result cap
	DefaultHandlerTimeout  = time.Minute
)

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
	// MaxResponseBody caps the stored response body. A larger response is
	// sent in full, and stored without its body (status and replay headers
	// only, Response.BodyOmitted): the handler ran, so a duplicate is
	// answered with that status instead of running it again. Default 512 KiB.
	MaxResponseBody int
	// ReplayHeaders are the response headers stored and replayed.
	// Default: Content-Type, Content-Language, Location, Cache-Control, ETag.
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
	// Scope, in the IETF Idempotency-Key mode, names the client a key
	// belongs to: the same key from two clients is two keys, so one
	// client's stored answer never reaches another. Return the
	// authenticated principal (a user or tenant id) where you have one.
	// Default: CredentialsScope, a digest of the request's credentials.
	// The webhook presets key by the sender's event id and have no scope.
	Scope func(r *http.Request) string
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
	// it instead of running the work again. Default (0) 1 minute.
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
	guardBody     bool     // a preset whose signature covers the body only: the replay guard
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
}

// Response is what the middleware stores for a key: enough to replay the
// first answer byte for byte.
type Response struct {
	Status  int                 `json:"status"`
	Headers map[string][]string `json:"headers,omitempty"`
	Body    []byte              `json:"body"` // base64 in JSON
	// BodyOmitted: the body was over MaxResponseBody and was not stored;
	// a replay sends the status and headers with an empty body.
	BodyOmitted bool `json:"body_omitted,omitempty"`
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
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusRequestTimeout,
		http.StatusConflict, http.StatusTooEarly, http.StatusTooManyRequests:
		return false
	}
	return status < 500
}

// CredentialsScope scopes a key to the request's credentials: a SHA-256
// digest of its Authorization, Proxy-Authorization and X-Api-Key headers
// (16 bytes, hex). Requests without any share the scope "anonymous": give
// Config.Scope your authenticated principal when clients authenticate
// some other way.
func CredentialsScope(r *http.Request) string {
	a, p, k := r.Header.Values("Authorization"), r.Header.Values("Proxy-Authorization"), r.Header.Values("X-Api-Key")
	if len(a)+len(p)+len(k) == 0 {
		return "anonymous"
	}
	h := sha256.New()
	for _, vs := range [][]string{a, p, k} {
		for _, v := range vs {
			h.Write([]byte(v))
			h.Write([]byte{0})
		}
		h.Write([]byte{1})
	}
	return "c:" + hex.EncodeToString(h.Sum(nil)[:16])
}

// New returns the middleware, or an error for an invalid Config: among
// others a preset's bad secret (ErrInvalidSecret) and a source taken by
// another endpoint over the same Client (ErrSourceInUse).
func New(cfg Config) (func(http.Handler) http.Handler, error) {
	if cfg.Client == nil {
		return nil, errors.New("idemhttp: Config.Client is required")
	}
	if cfg.Source == "" {
		return nil, errors.New("idemhttp: Config.Source is required")
	}
	if cfg.presetErr != nil {
		return nil, cfg.presetErr
	}
	if cfg.sender != "" && cfg.Verify == nil && !cfg.VerifiedUpstream {
		return nil, fmt.Errorf("idemhttp: the %s preset has no signing secret: pass the endpoint's secret (idemhttp.%s(secret)), "+
			"or set Config.VerifiedUpstream if deliveries are verified before this middleware", cfg.sender, cfg.sender)
	}
	if cfg.Key == nil {
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
		return nil, errors.New("idemhttp: body caps must not be negative")
	}
	if cfg.TTL < 0 || cfg.Lease < 0 {
		return nil, fmt.Errorf("idemhttp: TTL %v and Lease %v must not be negative (0: the source's policy)", cfg.TTL, cfg.Lease)
	}
	if cfg.Wait < 0 || cfg.Wait > idem.MaxWait {
		return nil, fmt.Errorf("idemhttp: Wait %v must be between 0 (no waiting) and %v", cfg.Wait, idem.MaxWait)
	}
	if cfg.HandlerTimeout < 0 {
		return nil, fmt.Errorf("idemhttp: HandlerTimeout %v must not be negative (0: the default %v)", cfg.HandlerTimeout, DefaultHandlerTimeout)
	}
	if cfg.HandlerTimeout == 0 {
		cfg.HandlerTimeout = DefaultHandlerTimeout
	}
	if cfg.ReplayHeaders == nil {
		cfg.ReplayHeaders = []string{"Content-Type", "Content-Language", "Location", "Cache-Control", "ETag"}
	}
	if cfg.Store == nil {
		cfg.Store = StoreIETF
		if cfg.sender != "" {
			cfg.Store = Store2xx
		}
	}
	if cfg.Scope == nil && cfg.sender == "" {
		cfg.Scope = CredentialsScope
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
		return &middleware{cfg: cfg, next: next}
	}, nil
}

type middleware struct {
	cfg  Config
	next http.Handler
}

// errRetry marks a handler answer that releases the key.
type errRetry struct{ status int }

func (e errRetry) Error() string { return fmt.Sprintf("handler answered %d", e.status) }

func (m *middleware) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a := m.serve(w, r)
	m.decided(r, "", DecisionAnswered, string(a))
	if m.cfg.Observer != nil {
		m.cfg.Observer.ObserveAnswer(m.cfg.Source, a)
	}
}

// serve answers r and says how.
// legacyFingerprints are the fingerprints earlier versions stored for
// this delivery, other than fp.
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

func (m *middleware) serve(w http.ResponseWriter, r *http.Request) Answer {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, m.cfg.MaxRequestBody))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			problem(w, http.StatusRequestEntityTooLarge, "Request body too large",
				fmt.Sprintf("The request body exceeds %d bytes.", m.cfg.MaxRequestBody), nil)
			return AnswerBadRequest
		}
		problem(w, http.StatusBadRequest, "Unreadable request body", err.Error(), nil)
		return AnswerBadRequest
	}
	r.Body = io.NopCloser(newReader(body))
	if m.cfg.Verify != nil {
		if err := m.cfg.Verify(r, body); err != nil {
			status, title, why := http.StatusUnauthorized, "Signature verification failed", RefusedSignatureInvalid
			if errors.Is(err, ErrSignatureMissing) {
				status, title, why = http.StatusBadRequest, "Signature missing or malformed", RefusedSignatureMissing
			}
			m.decided(r, "", DecisionRefused, why)
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: delivery refused before any claim",
				append([]slog.Attr{slog.String("source", m.cfg.Source), slog.Any("error", err)}, refusalAttrs(err)...)...)
			problem(w, status, title, err.Error(), nil)
			return AnswerRefused
		}
		m.decided(r, "", DecisionVerified, "")
	}
	if m.cfg.handshake != nil && m.cfg.handshake(w, r, body) {
		return AnswerHandshake
	}
	if m.cfg.batch != nil {
		return m.serveBatch(w, r, body)
	}
	key, eventType, err := m.cfg.Key(r, body)
	if err != nil {
		problem(w, http.StatusBadRequest, "Invalid idempotency key", err.Error(), nil)
		return AnswerBadRequest
	}
	if key == "" {
		if m.cfg.PassThroughMissingKey {
			m.next.ServeHTTP(w, r)
			return AnswerPassedThrough
		}
		problem(w, http.StatusBadRequest, "Idempotency key missing",
			"This endpoint requires an idempotency key (the Idempotency-Key header, or the sender's delivery id).", nil)
		return AnswerBadRequest
	}

	if m.cfg.Scope != nil {
		key = idem.ScopeKey(m.cfg.Scope(r), key)
	}
	if m.cfg.Async != nil {
		d := &Delivery{Source: m.cfg.Source, Key: key, EventType: eventType,
			Fingerprint: m.cfg.Fingerprint(r, body), Body: body, Header: m.keep(r.Header),
			TTL: m.cfg.TTL, Lease: m.cfg.Lease, Target: RequestTarget(r), Host: r.Host, Pattern: r.Pattern}
		if m.cfg.guardBody {
			d.GuardSource, d.GuardKey = m.cfg.Source+GuardSuffix, GuardKey(eventType, body)
		}
		return m.accept(w, r, d)
	}
	if m.cfg.guardBody {
		replay, done, err := m.guard(r.Context(), key, eventType, body)
		switch {
		case err != nil:
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: idempotency store failed",
				slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
			problem(w, http.StatusServiceUnavailable, "Idempotency store unavailable",
				"The request was not processed; retry later.", map[string]string{"Retry-After": "5"})
			return AnswerUnavailable
		case replay:
			m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: a signed body delivered before under another delivery id: answered as a duplicate, nothing run",
				slog.String("source", m.cfg.Source), slog.String("key", key))
			return m.replayedCopy(w, r, key)
		}
		defer done()
	}
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

	// Detached from the request: once the handler starts, the sender
	// hanging up must not cancel it or keep its answer from being recorded.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), m.cfg.HandlerTimeout)
	defer cancel()
	var rec *recorder
	work := func(ctx context.Context) (any, error) {
		rec = newRecorder(m.cfg.MaxResponseBody)
		m.next.ServeHTTP(rec, r.WithContext(ctx))
		if !m.cfg.Store(rec.status()) {
			return nil, errRetry{rec.status()}
		}
		if rec.overflow {
			m.cfg.Logger.LogAttrs(ctx, slog.LevelWarn, "idemhttp: response body too large to store; stored its status and headers only",
				slog.String("source", m.cfg.Source), slog.String("key", key), slog.Int("limit", m.cfg.MaxResponseBody))
		}
		return m.stored(rec), nil
	}
	var res *idem.Result
	fp := m.cfg.Fingerprint(r, body)
	do := func(fp string) (*idem.Result, error) {
		if fp == "" {
			return m.cfg.Client.Do(ctx, m.cfg.Source, key, work, opts...)
		}
		return m.cfg.Client.Do(ctx, m.cfg.Source, key, work, append(opts, idem.WithFingerprint(fp))...)
	}
	res, err = do(fp)
	// A key stored by an earlier version under another fingerprint of the
	// same delivery (a sender preset's body-only fingerprint, or
	// JSONFingerprint's numbers as written): its sender's retry is not a
	// mismatch.
	for _, old := range m.legacyFingerprints(r, body, fp) {
		if !errors.Is(err, idem.ErrMismatch) {
			break
		}
		res, err = do(old)
	}

	switch {
	case err == nil && res.Replayed:
		m.replay(w, r, key, res.Result)
		return AnswerReplayed
	case err == nil:
		rec.flushTo(w)
		return AnswerRan
	case errors.Is(err, idem.ErrInProgress):
		retry := 1 // by the database's clock, never compared with ours
		if res != nil && res.Claim != nil {
			retry = max(1, int(math.Ceil(res.Claim.LeaseRemaining.Seconds())))
		}
		problem(w, http.StatusConflict, "Request in progress",
			"A request with this idempotency key is being processed; retry later.",
			map[string]string{"Retry-After": strconv.Itoa(retry)})
		return AnswerInProgress
	case errors.Is(err, idem.ErrMismatch):
		problem(w, http.StatusUnprocessableEntity, "Idempotency key reused",
			"This idempotency key was used with a different request payload.", nil)
		return AnswerMismatch
	case errors.Is(err, idem.ErrFailed):
		var fe *idem.FailedError
		errors.As(err, &fe)
		problem(w, http.StatusUnprocessableEntity, "Request failed permanently", fe.Message, nil)
		return AnswerFailed
	case errors.Is(err, idem.ErrInvalidInput):
		problem(w, http.StatusBadRequest, "Invalid idempotency key", err.Error(), nil)
		return AnswerBadRequest
	case rec != nil && errors.Is(err, idem.ErrLeaseLost):
		// The lease lapsed while the handler ran (it could not be extended
		// in time) and another worker took the key over. That run's answer
		// is the one stored. This run's answer, if the handler wrote one,
		// is sent as it is; if the handler stopped when its context was
		// cancelled, the sender is told to retry and will get that answer.
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: the lease was lost while the handler ran; another worker took the key over",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		if rec.written() {
			rec.flushTo(w)
			return AnswerLeaseLost
		}
		problem(w, http.StatusConflict, "Request taken over",
			"The lease on this idempotency key lapsed while it was processed and another worker took it over; retry to get its answer.",
			map[string]string{"Retry-After": "1"})
		return AnswerLeaseLost
	case rec != nil && errors.Is(err, idem.ErrResultNotStored):
		// The handler ran and the key is completed without its answer
		// (duplicates get 200 with no body): send this run's answer.
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn, "idemhttp: the response could not be stored; the key is completed without it",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		rec.flushTo(w)
		return AnswerRan
	case rec != nil && errors.As(err, new(errRetry)):
		// The handler answered; its answer was not stored. Send it as is.
		rec.flushTo(w)
		return AnswerRan
	case rec != nil && errors.As(err, new(*idem.PanicError)):
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: handler panicked; the key was released",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		problem(w, http.StatusInternalServerError, "Internal error", "The handler failed; retry the request.", nil)
		return AnswerPanicked
	default:
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelError, "idemhttp: idempotency store failed",
			slog.String("source", m.cfg.Source), slog.String("key", key), slog.Any("error", err))
		if rec != nil && rec.written() {
			// The handler ran: its answer is the truth, even if it could
			// not be stored.
			rec.flushTo(w)
			return AnswerRan
		}
		problem(w, http.StatusServiceUnavailable, "Idempotency store unavailable",
			"The request was not processed; retry later.", map[string]string{"Retry-After": "5"})
		return AnswerUnavailable
	}
}

func (m *middleware) stored(rec *recorder) Response {
	resp := Response{Status: rec.status(), Body: rec.body.Bytes(), Headers: map[string][]string{}}
	if rec.overflow {
		resp.Body, resp.BodyOmitted = nil, true
	}
	for _, h := range m.cfg.ReplayHeaders {
		if v := rec.header.Values(h); len(v) > 0 {
			resp.Headers[http.CanonicalHeaderKey(h)] = v
		}
	}
	return resp
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

// problem writes an RFC 9457 problem+json response.
func problem(w http.ResponseWriter, status int, title, detail string, headers map[string]string) {
	for k, v := range headers {
		w.Header().Set(k, v)
	}
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"type":   "about:blank",
		"title":  title,
		"status": status,
		"detail": detail,
	})
}
