package testnats_test

import (
	"bufio"
	"net"
	"os"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testnats"
)

// TestStart: two servers start side by side on ports of their own, each
// answers a client with JetStream on, and Stop ends the process and removes
// its store.
func TestStart(t *testing.T) {
	a, b := testnats.Start(t), testnats.Start(t)
	if a.URL == b.URL || !strings.HasPrefix(a.URL, "nats://127.0.0.1:") {
		t.Fatalf("URLs %q and %q", a.URL, b.URL)
	}
	conn, err := net.Dial("tcp", strings.TrimPrefix(a.URL, "nats://"))
	if err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	conn.Close()
	if err != nil || !strings.Contains(line, `"jetstream":true`) {
		t.Fatalf("INFO %q, %v", line, err)
	}
	a.Stop()
	if _, err := net.Dial("tcp", strings.TrimPrefix(a.URL, "nats://")); err == nil {
		t.Fatal("the stopped server still accepts connections")
	}
	if _, err := os.Stat(testnats.Dir(a)); !os.IsNotExist(err) {
		t.Fatalf("the stopped server's directory is still there: %v", err)
	}
}

// TestNoBinary: without nats-server the error says how to install it.
func TestNoBinary(t *testing.T) {
	testnats.SetBinaries(t, "/nonexistent/nats-server")
	_, err := testnats.Binary()
	if err == nil || !strings.Contains(err.Error(), "apt-get install nats-server") {
		t.Fatalf("Binary() = %v; want an error saying how to install nats-server", err)
	}
}
