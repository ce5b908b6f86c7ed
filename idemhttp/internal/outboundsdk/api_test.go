package outboundsdk_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// api is a local stand-in for a provider's write endpoint. Every request
// that is not a repeat acts (a charge, a message, a task) and is counted;
// a request whose key (key's answer; "" for none) was seen before is a
// repeat, answered as the first was without acting, as Stripe's
// Idempotency-Key and AWS's ClientToken are. The first lose requests that
// act lose their answer: the API acts, then hangs up, as a cut connection
// or a crash before the answer would; so do the first loseAny requests,
// acting or not.
type api struct {
	key     func(r *http.Request, body []byte) string    // nil: the API takes no key
	answer  func(w http.ResponseWriter, id, body string) // the answer for the action id, done for body
	lose    int
	loseAny int

	mu      sync.Mutex
	keys    []string          // the key of every request, in order
	acted   []string          // the body of every action, in order
	byKey   map[string]string // key -> id of the action it made
	bodyFor map[string]string // id -> body of that action
}

func (a *api) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	key := ""
	if a.key != nil {
		key = a.key(r, b)
	}
	a.mu.Lock()
	a.keys = append(a.keys, key)
	if a.byKey == nil {
		a.byKey, a.bodyFor = map[string]string{}, map[string]string{}
	}
	id, seen := a.byKey[key]
	seen = seen && key != ""
	lost := false
	if !seen {
		a.acted = append(a.acted, string(b))
		id = "act_" + strconv.Itoa(len(a.acted))
		a.byKey[key], a.bodyFor[id] = id, string(b)
		if a.lose > 0 {
			a.lose--
			lost = true
		}
	}
	if a.loseAny > 0 {
		a.loseAny--
		lost = true
	}
	body := a.bodyFor[id]
	a.mu.Unlock()
	if lost {
		conn, _, _ := w.(http.Hijacker).Hijack()
		conn.Close()
		return
	}
	a.answer(w, id, body)
}

// counts returns how often the API acted and the key of every request.
func (a *api) counts() (acted int, keys []string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.acted), append([]string(nil), a.keys...)
}

// serve starts a on a local server.
func serve(t *testing.T, a http.Handler) *httptest.Server {
	srv := httptest.NewServer(a)
	t.Cleanup(srv.Close)
	return srv
}

// headerKey reads the key from the Idempotency-Key header.
func headerKey(r *http.Request, _ []byte) string { return r.Header.Get("Idempotency-Key") }

// redirect is a base RoundTripper that sends every request to a local
// server, whatever host the client library addressed (twilio-go builds
// its URLs from api.twilio.com, with no option to change it).
type redirect struct{ to *url.URL }

func (rd redirect) RoundTrip(r *http.Request) (*http.Response, error) {
	r2 := r.Clone(r.Context())
	r2.URL.Scheme, r2.URL.Host, r2.Host = rd.to.Scheme, rd.to.Host, ""
	return http.DefaultTransport.RoundTrip(r2)
}

func redirectTo(t *testing.T, srv *httptest.Server) redirect {
	u, err := url.Parse(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	return redirect{to: u}
}

// form returns field of an url-encoded body.
func form(body, field string) string {
	v, _ := url.ParseQuery(body)
	return strings.TrimSpace(v.Get(field))
}
