package idemhttp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"reflect"
	"strings"

	"github.com/idemkit/idem"
)

// ErrScopeRequired: New was given the default Key (the Idempotency-Key
// header, which each client chooses) without Config.Scope. Keys chosen by
// clients must be scoped by the principal the application authenticated
// (Config.Scope), or declared shared (Unscoped). It matches
// ErrInvalidConfig too.
var ErrScopeRequired = fmt.Errorf("%w: Config.Scope is required with client-chosen Idempotency-Key headers: "+
	"return the authenticated principal (user, tenant or API client id) from Config.Scope, or set Config.Scope to idemhttp.Unscoped "+
	"if every client may share every key", ErrInvalidConfig)

// ErrNoPrincipal is what Config.Scope may return for a request whose
// principal is unknown: it is answered 401 problem+json and nothing is
// claimed. Any other error is answered the same way.
var ErrNoPrincipal = errors.New("idemhttp: the request has no authenticated principal")

// Unscoped is a Config.Scope for endpoints whose Idempotency-Key values
// are shared by every client: one client, or keys unique by construction
// (UUIDs minted by a trusted caller). One client's stored answer is
// replayed to any other that sends its key. Its keys are stored as they
// are: with Unscoped no request has a principal, so there is no
// principal's space for them to meet.
func Unscoped(*http.Request) (string, error) { return "", nil }

// principalKey is the context key of the request's principal.
type principalKey struct{}

// Principal returns the principal Config.Scope named for the request
// being handled, from its context ("" when it has none, or the middleware
// no Scope). It is how a handler reads its principal in both modes: the
// middleware sets it on the handler's request synchronously, and the
// inbox's worker (inbox.FromHTTP) on the request it replays, from the
// principal kept with the delivery; the application's own authentication
// context is not there behind the inbox (no credential is stored).
func Principal(ctx context.Context) string {
	p, _ := ctx.Value(principalKey{}).(string)
	return p
}

// WithPrincipal returns ctx carrying principal, as Principal reads it: the
// inbox's worker sets a delivery's principal with it.
func WithPrincipal(ctx context.Context, principal string) context.Context {
	return context.WithValue(ctx, principalKey{}, principal)
}

// isUnscoped reports whether scope is Unscoped itself (not a function of
// the application's that returns "" for some requests).
func isUnscoped(scope func(*http.Request) (string, error)) bool {
	return scope != nil && reflect.ValueOf(scope).Pointer() == reflect.ValueOf(Unscoped).Pointer()
}

// scoped returns key in its principal's scope (Config.Scope), and the
// principal, or answers 401 when the principal is unknown. Every key of a
// middleware with a Scope (but Unscoped) is idem.ScopeKey(principal, key),
// the one composition, "" included: a request without a principal keys
// "|" + key, which no principal's key ever is (a principal is never empty,
// and ScopeKey escapes a "|" in it), so the space of requests without a
// principal and every principal's space never meet, whatever bytes a key
// holds (alice's "order-1" is "alice|order-1"; a guest sending
// "alice|order-1" is "|alice|order-1").
func (m *middleware) scoped(w http.ResponseWriter, r *http.Request, key string) (scopedKey, principal string, ok bool) {
	if m.cfg.Scope == nil || m.unscoped {
		return key, "", true
	}
	principal, err := m.cfg.Scope(r)
	if err != nil {
		m.problem(w, r, problemAnswer{status: http.StatusUnauthorized, title: "Unauthenticated",
			detail: "The request's client could not be identified; authenticate and retry with the same idempotency key.",
			level:  slog.LevelInfo, msg: "idemhttp: Config.Scope named no principal; nothing claimed", cause: err})
		return "", "", false
	}
	return idem.ScopeKey(principal, key), principal, true
}

// legacyKey is the key an earlier version stored for the request, when
// it is stored and provably the request's own space's; else key.
//
// A request without a principal under a Config.Scope (but Unscoped) was
// keyed by its key as it is, which overlapped every principal's space;
// it is now ScopeKey("", key). Its raw key is looked up (idem.Client.Peek,
// one read-only query) only when it holds no "|": every principal's key
// holds one, so such a key was stored by a request without a principal,
// and its retry across the upgrade is answered from it. A raw key holding
// "|" may be a principal's and is never looked up: that retry runs again.
//
// A request to a middleware without a preset or Config.Scope: every such
// key was once prefixed with a digest of the request's credentials, or
// "anonymous" for a request without any. For a request without
// credentials whose key is stored that way, that key is used, so that a
// sender's retry that crosses the upgrade is answered from it instead of
// running again. A key stored under a credential digest is not looked up:
// that would mean digesting credentials.
func (m *middleware) legacyKey(r *http.Request, key, rawKey, principal string) string {
	if m.cfg.Scope != nil && !m.unscoped {
		if principal != "" || strings.Contains(rawKey, "|") {
			return key
		}
		return m.storedOr(r, rawKey, key)
	}
	if m.cfg.Scope != nil || m.cfg.sender != "" {
		return key
	}
	if len(r.Header.Values("Cookie")) > 0 {
		m.warnUnscoped(r)
	}
	for _, h := range []string{"Authorization", "Proxy-Authorization", "X-Api-Key"} {
		if len(r.Header.Values(h)) > 0 {
			m.warnUnscoped(r)
			return key
		}
	}
	return m.storedOr(r, idem.ScopeKey("anonymous", key), key)
}

// storedOr returns old when a key is stored under it, else key.
func (m *middleware) storedOr(r *http.Request, old, key string) string {
	if status, err := m.cfg.Client.Peek(r.Context(), m.cfg.Source, old); err == nil && status != "" {
		return old
	}
	return key
}

// warnUnscoped says, once per middleware, that requests carry credentials
// while keys are not scoped: right for keys that identify an event
// (JSONKey), wrong for keys each client chooses (a HeaderKey of the
// client's own request id), which Config.Scope must then scope.
func (m *middleware) warnUnscoped(r *http.Request) {
	m.unscopedWarning.Do(func() {
		m.cfg.Logger.LogAttrs(r.Context(), slog.LevelWarn,
			"idemhttp: requests carry credentials (Authorization, Cookie, ...) and Config.Scope is not set: keys are shared by every client; "+
				"if clients choose their keys, set Config.Scope to the authenticated principal",
			slog.String("source", m.cfg.Source))
	})
}
