package idemhttp

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"weak"

	"github.com/idemkit/idem"
)

// One endpoint per source. A source is the namespace of an endpoint's
// keys: two endpoints sharing one (two Stripe accounts, two GitHub hooks
// under the same preset's default source) would answer one's deliveries
// with the other's stored answers, and the second endpoint's handler
// would never run for an event id they share. New keeps, per idem.Client,
// the endpoints that took each source, told apart by their signing
// secrets, and refuses a middleware that would share a source with
// another endpoint:
//
//   - two presets with secrets share a source only if they share a secret
//     (the same endpoint built twice, or mid-rotation: {old} and
//     {old, new});
//   - a middleware without known secrets (Config.Verify, VerifiedUpstream,
//     the IETF mode) shares a source only that both name themselves
//     (Config.Source): a preset's default source is never shared with
//     it.
//
// The check cannot see other processes or other Clients: each endpoint's
// Source must still be its own there (docs/senders.md).

// ErrSourceInUse: the source is already taken by another endpoint over
// the same Client. Give each endpoint its own Config.Source.
var ErrSourceInUse = errors.New("idemhttp: source already used by another endpoint")

type endpoint struct {
	secrets map[[32]byte]bool // digests of the signing secrets; empty: unknown
	named   bool              // every middleware of the source named it itself
}

var endpoints = struct {
	sync.Mutex
	byClient map[weak.Pointer[idem.Client]]map[string]*endpoint
}{byClient: map[weak.Pointer[idem.Client]]map[string]*endpoint{}}

// claimSource registers cfg's source for cfg.Client, or refuses it.
func claimSource(cfg *Config) error {
	secrets := map[[32]byte]bool{}
	for _, s := range cfg.secrets {
		secrets[sha256.Sum256([]byte(s))] = true
	}
	wp := weak.Make(cfg.Client)
	endpoints.Lock()
	defer endpoints.Unlock()
	sources, ok := endpoints.byClient[wp]
	if !ok {
		sources = map[string]*endpoint{}
		endpoints.byClient[wp] = sources
		// Forget the Client's sources once it is collected.
		runtime.AddCleanup(cfg.Client, func(wp weak.Pointer[idem.Client]) {
			endpoints.Lock()
			delete(endpoints.byClient, wp)
			endpoints.Unlock()
		}, wp)
	}
	prev, ok := sources[cfg.Source]
	if !ok {
		sources[cfg.Source] = &endpoint{secrets: secrets, named: !cfg.defaultSource}
		return nil
	}
	shared := false
	for d := range secrets {
		shared = shared || prev.secrets[d]
	}
	switch {
	case len(secrets) > 0 && len(prev.secrets) > 0 && !shared:
		return fmt.Errorf("%w: source %q is taken by an endpoint with other signing secrets: "+
			"give each endpoint its own Config.Source (\"%s-billing\"), or one middleware all the secrets of one endpoint",
			ErrSourceInUse, cfg.Source, cfg.Source)
	case (len(secrets) == 0 || len(prev.secrets) == 0) && (!prev.named || cfg.defaultSource):
		return fmt.Errorf("%w: source %q is taken by another middleware, and one of them has no signing secrets to tell the endpoints apart: "+
			"name the source of each endpoint in Config.Source (the same name only for the same endpoint)", ErrSourceInUse, cfg.Source)
	}
	for d := range secrets {
		prev.secrets[d] = true
	}
	prev.named = prev.named && !cfg.defaultSource
	return nil
}
