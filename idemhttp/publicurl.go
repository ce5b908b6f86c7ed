package idemhttp

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strings"
)

// PublicURL says how a preset whose sender signs the URL it called
// (Twilio, Square, HubSpot v3) learns that URL. Behind a reverse proxy or
// a load balancer the request this process sees (http://10.0.0.7:8080/...)
// is not the one the sender signed (https://hooks.example.com/...).
//
// In order: Base, when set, replaces the scheme, host and any path prefix
// the proxy strips ("https://hooks.example.com" or
// "https://example.com/hooks"); the request's own path and query follow
// it. Else, when the connection comes from one of TrustedProxies, the
// scheme and host are the first X-Forwarded-Proto and X-Forwarded-Host
// values that proxy set. Else the request's own (https when it came over
// TLS, its Host). Forwarded headers from any other peer are ignored:
// anyone can send them.
//
// A delivery whose signature does not match the URL computed this way is
// refused (401) with a *URLMismatchError, logged with the computed URL
// and, when another URL the request could stand for does verify (its Host,
// the forwarded headers of an untrusted peer, the other scheme, the
// default port), that URL: the configuration to fix.
type PublicURL struct {
	Base           string
	TrustedProxies []netip.Prefix
}

// ErrURLMismatch: the signature does not cover the URL computed for the
// request (*URLMismatchError says which).
var ErrURLMismatch = errors.New("idemhttp: the signature does not match the computed public URL")

// URLMismatchError is a URL-covering signature that does not match the
// URL computed for the request. Expected is a URL it does match, when one
// of the request's other readings does ("" when none does: a wrong secret,
// or a URL this process cannot guess).
type URLMismatchError struct {
	Sender, Computed, Expected string
}

func (e *URLMismatchError) Error() string {
	if e.Expected == "" {
		return fmt.Sprintf("%s: the signature does not match the computed public URL %s, nor any other reading of the request (a wrong secret, or a URL to set in idemhttp.PublicURL.Base)", e.Sender, e.Computed)
	}
	return fmt.Sprintf("%s: the signature does not match the computed public URL %s; it matches %s: set idemhttp.PublicURL (Base, or TrustedProxies for the proxy that forwards it)", e.Sender, e.Computed, e.Expected)
}

func (e *URLMismatchError) Unwrap() []error { return []error{ErrURLMismatch, ErrSignatureInvalid} }

// refusalAttrs are the log attributes of a refusal beyond its error: the
// computed and expected URL of a URL mismatch.
func refusalAttrs(err error) []slog.Attr {
	var um *URLMismatchError
	if !errors.As(err, &um) {
		return nil
	}
	return []slog.Attr{slog.String("computed_url", um.Computed), slog.String("expected_url", um.Expected)}
}

// check validates the configuration at construction.
func (p PublicURL) check(sender string) error {
	if p.Base == "" {
		return nil
	}
	u, err := url.Parse(p.Base)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Host == "" || u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("idemhttp: %s: PublicURL.Base %q must be an absolute http(s) URL without query, e.g. https://hooks.example.com", sender, p.Base)
	}
	return nil
}

// of returns the public URL of r as configured.
func (p PublicURL) of(r *http.Request) string {
	uri := r.URL.RequestURI()
	if p.Base != "" {
		return strings.TrimSuffix(p.Base, "/") + uri
	}
	if p.trusted(r) {
		if proto, host := firstValue(r.Header.Get("X-Forwarded-Proto")), firstValue(r.Header.Get("X-Forwarded-Host")); proto != "" && host != "" {
			return proto + "://" + host + uri
		}
	}
	return ownURL(r)
}

// ownURL is the URL of r as this process received it.
func ownURL(r *http.Request) string {
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	return scheme + "://" + r.Host + r.URL.RequestURI()
}

func firstValue(v string) string {
	first, _, _ := strings.Cut(v, ",")
	return strings.TrimSpace(first)
}

// trusted reports whether r's peer is one of the trusted proxies.
func (p PublicURL) trusted(r *http.Request) bool {
	if len(p.TrustedProxies) == 0 {
		return false
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	ip = ip.Unmap()
	for _, pr := range p.TrustedProxies {
		if pr.Contains(ip) {
			return true
		}
	}
	return false
}

// others are the URLs r could stand for besides computed: tried only to
// name the right one in a mismatch's error, never to accept a delivery.
func (p PublicURL) others(r *http.Request, computed string) []string {
	uri := r.URL.RequestURI()
	seen := map[string]bool{computed: true}
	var out []string
	add := func(u string) {
		for _, v := range portVariants(u) {
			for _, s := range []string{v, swapScheme(v)} {
				if !seen[s] {
					seen[s] = true
					out = append(out, s)
				}
			}
		}
	}
	add(computed)
	add(ownURL(r))
	hosts := []string{firstValue(r.Header.Get("X-Forwarded-Host")), r.Host}
	for _, h := range hosts {
		if h != "" {
			add("https://" + h + uri)
		}
	}
	return out
}

func swapScheme(u string) string {
	if s, ok := strings.CutPrefix(u, "https://"); ok {
		return "http://" + s
	}
	if s, ok := strings.CutPrefix(u, "http://"); ok {
		return "https://" + s
	}
	return u
}

// portVariants is u as given, with its scheme's default port added when
// it has none, and without it when it has it: senders sign the URL as
// configured, and some validators (Twilio's) accept either.
func portVariants(u string) []string {
	pu, err := url.Parse(u)
	if err != nil {
		return []string{u}
	}
	def := map[string]string{"https": "443", "http": "80"}[pu.Scheme]
	out := []string{u}
	switch pu.Port() {
	case "":
		c := *pu
		c.Host = pu.Host + ":" + def
		out = append(out, c.String())
	case def:
		c := *pu
		c.Host = pu.Hostname()
		out = append(out, c.String())
	}
	return out
}

// urlVerify checks a URL-covering signature: ok(url) says whether the
// signature matches url. It tries the computed public URL (and, where the
// sender's own validator does, its default-port variants), and on a
// mismatch looks for the URL the signature does match, for the error.
func urlVerify(sender string, p PublicURL, r *http.Request, portless bool, ok func(u string) bool) error {
	computed := p.of(r)
	tries := []string{computed}
	if portless {
		tries = portVariants(computed)
	}
	for _, u := range tries {
		if ok(u) {
			return nil
		}
	}
	e := &URLMismatchError{Sender: sender, Computed: computed}
	for _, u := range p.others(r, computed) {
		if ok(u) {
			e.Expected = u
			break
		}
	}
	return e
}
