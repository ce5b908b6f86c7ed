package sendersigned_test

import (
	"bufio"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/idemhttp"
	"github.com/idemkit/idem/idemhttp/idemtest"
	"github.com/idemkit/idem/internal/testdb"
)

// oracle is node/oracle.mjs running over the senders' own Node libraries,
// installed with npm ci from node/package-lock.json into a cache
// directory named by the lock's digest (nothing is vendored; a second run
// reuses the install).
type oracle struct {
	mu  sync.Mutex
	in  *json.Encoder
	out *bufio.Scanner
}

func startOracle(t *testing.T) *oracle {
	t.Helper()
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s is needed to check the presets against the senders' Node libraries (.ci/run installs nodejs and npm): %v", tool, err)
		}
	}
	lock, err := os.ReadFile("node/package-lock.json")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(lock)
	base, err := os.UserCacheDir()
	if err != nil {
		base = os.TempDir()
	}
	dir := filepath.Join(base, "idem-sendersigned-node", hex.EncodeToString(sum[:8]))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"package.json", "package-lock.json", "oracle.mjs"} {
		b, err := os.ReadFile(filepath.Join("node", f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, f), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", ".idem-installed")); err != nil {
		cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("npm ci in %s: %v\n%s", dir, err, out)
		}
		if err := os.WriteFile(filepath.Join(dir, "node_modules", ".idem-installed"), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("node", "oracle.mjs")
	cmd.Dir = dir
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		stdin.Close()
		_ = cmd.Wait()
	})
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	return &oracle{in: json.NewEncoder(stdin), out: sc}
}

// ask sends q and returns the library's answer.
func (o *oracle) ask(t *testing.T, q map[string]any) (ok bool, value string) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	if err := o.in.Encode(q); err != nil {
		t.Fatal(err)
	}
	if !o.out.Scan() {
		t.Fatalf("the Node oracle exited: %v", o.out.Err())
	}
	var a struct {
		OK           bool
		Value, Error string
	}
	if err := json.Unmarshal(o.out.Bytes(), &a); err != nil {
		t.Fatalf("oracle answer %q: %v", o.out.Text(), err)
	}
	return a.OK, a.Value
}

// lower is h with lower-case names and first values, as Node sees them.
func lower(h http.Header) map[string]string {
	m := map[string]string{}
	for k := range h {
		m[strings.ToLower(k)] = h.Get(k)
	}
	return m
}

func formParams(t *testing.T, body []byte) map[string]string {
	form, err := url.ParseQuery(string(body))
	if err != nil {
		t.Fatal(err)
	}
	p := map[string]string{}
	for k := range form {
		p[k] = form.Get(k)
	}
	return p
}

// TestSignedByNodeLibraries: the senders whose own library is a Node one
// (Square, HubSpot, Paddle, Linear, Adyen; Twilio's Node library besides
// twilio-go). Twilio's, HubSpot's and Adyen's libraries sign: the deliveries sent
// carry their signatures (which also equal idemtest's). Square's,
// Paddle's and Linear's only verify: each idemtest delivery is accepted
// by the library before it is sent. The preset accepts each and runs it
// once; a forged copy is refused by both the library and the preset.
// Adyen's library signs too (calculateHmac). Versions:
// node/package-lock.json (@adyen/api-library 32.1.0, twilio 6.2.0, square 46.0.0,
// @hubspot/api-client 13.5.0, @paddle/paddle-node-sdk 3.10.0, @linear/sdk
// 98.0.0).
func TestSignedByNodeLibraries(t *testing.T) {
	t.Parallel()
	o := startOracle(t)
	pool := testdb.Pool(t, testdb.New(t), 20)
	c := testdb.Client(t, pool, nil)
	const key = "node genuine secret"
	const adyenKey = "0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF0123456789ABCDEF"
	for _, tc := range []struct {
		name   string
		make   func(u string) (*idemtest.Sender, idemhttp.Preset)
		sign   func(t *testing.T, d *idemtest.Delivery, u string) // replace the signature with the library's
		verify func(t *testing.T, d *idemtest.Delivery, u string) bool
	}{
		{name: "twilio",
			make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.Twilio(key, u), idemhttp.Twilio(idemhttp.PublicURL{}, key)
			},
			sign: func(t *testing.T, d *idemtest.Delivery, u string) {
				_, sig := o.ask(t, map[string]any{"op": "twilio.sign", "key": key, "url": u, "params": formParams(t, d.Body)})
				if sig != d.Header.Get("X-Twilio-Signature") {
					t.Fatalf("twilio's getExpectedTwilioSignature %q, idemtest %q", sig, d.Header.Get("X-Twilio-Signature"))
				}
				d.Header.Set("X-Twilio-Signature", sig)
			},
			verify: func(t *testing.T, d *idemtest.Delivery, u string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "twilio.verify", "key": key, "url": u, "headers": lower(d.Header), "params": formParams(t, d.Body)})
				return ok
			}},
		{name: "twilio_json",
			make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.TwilioJSON(key, u), idemhttp.Twilio(idemhttp.PublicURL{}, key)
			},
			verify: func(t *testing.T, d *idemtest.Delivery, u string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "twilio.verify", "json": true, "key": key, "url": u + "&" + d.Query, "headers": lower(d.Header), "body": string(d.Body)})
				return ok
			}},
		{name: "hubspot",
			make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.HubSpot(key, u), idemhttp.HubSpot(idemhttp.PublicURL{}, key)
			},
			sign: func(t *testing.T, d *idemtest.Delivery, u string) {
				_, sig := o.ask(t, map[string]any{"op": "hubspot.sign", "key": key, "url": u, "body": string(d.Body), "timestamp": d.Header.Get("X-HubSpot-Request-Timestamp")})
				if sig != d.Header.Get("X-HubSpot-Signature-v3") {
					t.Fatalf("HubSpot's Signature.getSignature %q, idemtest %q", sig, d.Header.Get("X-HubSpot-Signature-v3"))
				}
				d.Header.Set("X-HubSpot-Signature-v3", sig)
			},
			verify: func(t *testing.T, d *idemtest.Delivery, u string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "hubspot.verify", "key": key, "url": u, "headers": lower(d.Header), "body": string(d.Body)})
				return ok
			}},
		{name: "adyen",
			make: func(string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.Adyen(adyenKey), idemhttp.Adyen(adyenKey)
			},
			sign: func(t *testing.T, d *idemtest.Delivery, _ string) {
				_, body := o.ask(t, map[string]any{"op": "adyen.sign", "key": adyenKey, "body": string(d.Body)})
				var lib, ours any
				_ = json.Unmarshal([]byte(body), &lib)
				_ = json.Unmarshal(d.Body, &ours)
				if !reflect.DeepEqual(lib, ours) { // the same items and signatures; JSON escapes may differ
					t.Fatalf("@adyen/api-library's calculateHmac signs\n%s\nidemtest\n%s", body, d.Body)
				}
				// Every item's signature is the library's (checked above); the
				// delivery keeps idemtest's bytes, which escape & as Go does.
			},
			verify: func(t *testing.T, d *idemtest.Delivery, _ string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "adyen.verify", "key": adyenKey, "body": string(d.Body)})
				return ok
			}},
		{name: "square",
			make: func(u string) (*idemtest.Sender, idemhttp.Preset) {
				return idemtest.Square(key, u), idemhttp.Square(idemhttp.PublicURL{}, key)
			},
			verify: func(t *testing.T, d *idemtest.Delivery, u string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "square.verify", "key": key, "url": u, "headers": lower(d.Header), "body": string(d.Body)})
				return ok
			}},
		{name: "paddle",
			make: func(string) (*idemtest.Sender, idemhttp.Preset) { return idemtest.Paddle(key), idemhttp.Paddle(key) },
			verify: func(t *testing.T, d *idemtest.Delivery, _ string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "paddle.verify", "key": key, "headers": lower(d.Header), "body": string(d.Body)})
				return ok
			}},
		{name: "linear",
			make: func(string) (*idemtest.Sender, idemhttp.Preset) { return idemtest.Linear(key), idemhttp.Linear(key) },
			verify: func(t *testing.T, d *idemtest.Delivery, _ string) bool {
				ok, _ := o.ask(t, map[string]any{"op": "linear.verify", "key": key, "headers": lower(d.Header), "body": string(d.Body)})
				return ok
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h http.Handler
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h.ServeHTTP(w, r) }))
			t.Cleanup(srv.Close)
			u := srv.URL + "/hooks/" + tc.name + "?a=1&b=two"
			sender, preset := tc.make(u)
			mw, err := idemhttp.New(idemhttp.Config{Client: c, Source: "node-" + tc.name}.Apply(preset))
			if err != nil {
				t.Fatal(err)
			}
			runs := idemtest.Count(nil)
			h = mw(runs)
			var ds []*idemtest.Delivery
			for range 3 {
				d := sender.Event("thing.happened", `{"text":"caf\u00e9 & \"quotes\" + spaces"}`)
				if tc.sign != nil {
					tc.sign(t, d, u)
				}
				if !tc.verify(t, d, u) {
					t.Fatalf("%s's own library refuses the delivery: %s %s", tc.name, d.Header, d.Body)
				}
				if resp, body := idemtest.Send(t, u, d); resp.StatusCode != 200 {
					t.Fatalf("the preset refuses a delivery %s's library accepts: %d %s", tc.name, resp.StatusCode, body)
				}
				forged := sender.Forge(d)
				if tc.verify(t, forged, u) {
					t.Fatalf("%s's own library accepts a forged delivery", tc.name)
				}
				if resp, _ := idemtest.Send(t, u, forged); resp.StatusCode != 401 {
					t.Fatalf("the preset answers a forged delivery %d, want 401", resp.StatusCode)
				}
				ds = append(ds, d)
			}
			runs.AssertOnce(t, ds...)
		})
	}
}
