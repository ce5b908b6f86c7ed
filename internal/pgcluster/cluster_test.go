package pgcluster

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestStartOnATakenPort: another process takes the port chosen for the
// server before the server binds it (two test binaries picking ports at
// once). Start, and Standby, start the server on another port instead of
// failing with an error that says to install PostgreSQL.
func TestStartOnATakenPort(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	var handed atomic.Int32
	pickPort = func() (int, error) {
		if handed.Add(1) <= 3 { // the next three picks lose the race
			return port, nil
		}
		return freePort()
	}
	t.Cleanup(func() { pickPort = freePort })

	ctx := context.Background()
	c, err := Start(ctx)
	if err != nil {
		t.Fatalf("Start with the first picks taken: %v", err)
	}
	defer c.Stop()
	if c.Port == port {
		t.Fatalf("the server claims the taken port %d", port)
	}
	ping(t, c)

	handed.Store(0)
	s, err := c.Standby(ctx)
	if err != nil {
		t.Fatalf("Standby with the first picks taken: %v", err)
	}
	defer s.Stop()
	if s.Port == port || s.Port == c.Port {
		t.Fatalf("the standby is on port %d (taken %d, primary %d)", s.Port, port, c.Port)
	}
	ping(t, s)
	if got := handed.Load(); got < 4 {
		t.Fatalf("%d ports picked: the taken ones were not tried", got)
	}

	// Every pick taken: a clear error, not an install hint.
	pickPort = func() (int, error) { return port, nil }
	if _, err := Start(ctx); err == nil || errors.Is(err, ErrNotInstalled) {
		t.Fatalf("Start with every port taken: %v", err)
	}
}

func ping(t *testing.T, c *Cluster) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var one int
	if err := conn.QueryRow(context.Background(), "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatal(one, err)
	}
}
