package idemhttp

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http"

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
// replayed to any other that sends its key.
func Unscoped(*http.Request) (string, error) { return "", nil }

// scoped returns key in its principal's scope (Config.Scope), or answers
// 401 when the principal is unknown.
func (m *middleware) scoped(w http.ResponseWriter, r *http.Request, key string) (string, bool) {
	if m.cfg.Scope == nil {
		return key, true
	}
	principal, err := m.cfg.Scope(r)
	if err != nil {
		m.problem(w, r, problemAnswer{status: http.StatusUnauthorized, title: "Unauthenticated",
			detail: "The request's client could not be identified; authenticate and retry with the same idempotency key.",
			level:  slog.LevelInfo, msg: "idemhttp: Config.Scope named no principal; nothing claimed", cause: err})
		return "", false
	}
	if principal == "" {
		return key, true
	}
	return idem.ScopeKey(principal, key), true
}

// legacyKey is the key an earlier version stored for a request to a
// middleware without a preset or Config.Scope: every such key was prefixed
// with a digest of the request's credentials, or "anonymous" for a request
// without any. For a request without credentials whose key is stored that
// way (idem.Client.Peek), that key is used, so that a sender's retry that
// crosses the upgrade is answered from it instead of running again. A key
// stored under a credential digest is not looked up: that would mean
// digesting credentials.
func (m *middleware) legacyKey(r *http.Request, key string) string {
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
	old := idem.ScopeKey("anonymous", key)
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
