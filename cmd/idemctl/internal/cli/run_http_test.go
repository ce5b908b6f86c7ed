package cli

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testdb"
)

// TestRunHTTPListenDefault: with --http and no --listen the daemon listens
// on loopback; another address only when --listen gives one; without
// --http, /healthz and /metrics keep listening on every interface.
func TestRunHTTPListenDefault(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		listen      string
		given, dash bool
		want        string
	}{
		{":9187", false, true, "127.0.0.1:9187"},
		{":9187", true, true, ":9187"},
		{"0.0.0.0:80", true, true, "0.0.0.0:80"},
		{":9187", false, false, ":9187"},
		{"", true, false, ""},
	} {
		if got := listenAddr(c.listen, c.given, c.dash); got != c.want {
			t.Errorf("listenAddr(%q, given %v, --http %v) = %q, want %q", c.listen, c.given, c.dash, got, c.want)
		}
	}
	r := idemctl(t, context.Background(), nil, "run", "--help")
	if !strings.Contains(r.out, "with --http and no --listen, 127.0.0.1:9187") {
		t.Errorf("run --help does not say where --http listens by default:\n%s", r.out)
	}
	for _, args := range [][]string{
		{"run", "--http-trusted-proxy", "10.0.0.2"},
		{"run", "--http", "--http-trusted-proxy", "proxy.example"},
		{"run", "--http", "--http-trusted-proxy", "10.0.0.0/33"},
		{"run", "--http", "--http-idle-timeout", "0"},
		{"run", "--http", "--http-read-timeout", "-1s"},
	} {
		if r := idemctl(t, context.Background(), nil, args...); r.code != ExitUsage {
			t.Errorf("%v: exit %d, want %d\n%s", args, r.code, ExitUsage, r.errout)
		}
	}
}

// TestRunHTTPTimeouts: a client that never finishes its request's headers,
// and one that keeps an idle keep-alive connection, are disconnected by
// the daemon (--http-read-timeout, --http-idle-timeout) instead of holding
// a connection for ever. Each read waits up to 30 s for the server's close:
// no assertion on how soon it comes.
func TestRunHTTPTimeouts(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	addr := freeAddr(t)
	var out, errw testdb.Buffer
	code := make(chan int, 1)
	go func() {
		code <- Main(ctx, []string{"run", "--database-url", url, "--listen", addr, "--http",
			"--http-read-timeout", "1s", "--http-idle-timeout", "1s", "--http-write-timeout", "10s"},
			&out, &errw, func(string) string { return "" })
	}()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		resp, err := http.Get("http://" + addr + "/healthz")
		if err == nil {
			resp.Body.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the daemon does not answer:\n%s", errw.String())
		}
	}
	closed := func(c net.Conn) error {
		_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
		_, err := io.Copy(io.Discard, c)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return err // the server kept the connection
		}
		return nil
	}
	t.Run("slow headers", func(t *testing.T) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: localhost\r\n"); err != nil {
			t.Fatal(err)
		}
		if err := closed(c); err != nil {
			t.Fatalf("a request whose headers never end keeps its connection: %v", err)
		}
	})
	t.Run("idle keep-alive", func(t *testing.T) {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := io.WriteString(c, "GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"); err != nil {
			t.Fatal(err)
		}
		br := bufio.NewReader(c)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.Close {
			t.Fatalf("healthz: %d, close %v", resp.StatusCode, resp.Close)
		}
		if err := closed(c); err != nil {
			t.Fatalf("an idle keep-alive connection stays open: %v", err)
		}
	})
	cancel()
	if c := <-code; c != 0 {
		t.Fatalf("exit %d after shutdown: %s", c, errw.String())
	}
}

// TestTrustedProxyRemoteUser: the dashboard's audit log records the
// Remote-User header only from a trusted proxy's address
// (--http-trusted-proxy); from any other address, or with no proxy
// configured, the header is dropped before the dashboard sees it.
func TestTrustedProxyRemoteUser(t *testing.T) {
	t.Parallel()
	seen := func(trusted ...string) string {
		var l proxyList
		for _, a := range trusted {
			if err := l.Set(a); err != nil {
				t.Fatal(err)
			}
		}
		srv := httptest.NewServer(trustProxies(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, r.Header.Get("Remote-User"))
		}), l))
		defer srv.Close()
		req, err := http.NewRequest(http.MethodGet, srv.URL, nil)
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Remote-User", "alice")
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	// httptest listens on 127.0.0.1: the client's address is 127.0.0.1.
	for _, c := range []struct {
		trusted []string
		want    string
	}{
		{nil, ""},
		{[]string{"10.0.0.2"}, ""},
		{[]string{"10.0.0.0/8,192.168.0.0/16"}, ""},
		{[]string{"127.0.0.1"}, "alice"},
		{[]string{"10.0.0.2", "127.0.0.0/8"}, "alice"},
		{[]string{"::ffff:127.0.0.1"}, "alice"},
	} {
		if got := seen(c.trusted...); got != c.want {
			t.Errorf("trusted %v: the dashboard saw Remote-User %q, want %q", c.trusted, got, c.want)
		}
	}
}
