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

// TestPromote: a setting overrides Start's defaults and a standby inherits
// it; a standby started OnPort listens there; Crash stops a primary at once
// and Promote makes its standby a primary that accepts writes, on a new
// timeline, with what the primary wrote before.
func TestPromote(t *testing.T) {
	ctx := context.Background()
	c, err := Start(ctx, Setting("synchronous_commit", "on"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Stop)
	run(t, c, `CREATE TABLE written (x int)`)
	run(t, c, `INSERT INTO written VALUES (1)`)
	port, err := freePort()
	if err != nil {
		t.Fatal(err)
	}
	s, err := c.Standby(ctx, OnPort(port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	if s.Port != port {
		t.Fatalf("the standby is on port %d, not %d", s.Port, port)
	}
	for _, cl := range []*Cluster{c, s} {
		if got := show(t, cl, `SHOW synchronous_commit`); got != "on" {
			t.Fatalf("synchronous_commit on port %d: %s", cl.Port, got)
		}
	}
	c.Crash()
	if err := s.Promote(ctx); err != nil {
		t.Fatal(err)
	}
	if got := show(t, s, `SELECT pg_is_in_recovery()::text || ' ' || (SELECT count(*) FROM pg_ls_waldir() WHERE name = '00000002.history')::text`); got != "false 1" {
		t.Fatalf("after the promotion (in recovery, timeline 2's history files): %s", got)
	}
	run(t, s, `INSERT INTO written VALUES (2)`)
	if got := show(t, s, `SELECT string_agg(x::text, ',' ORDER BY x) FROM written`); got != "1,2" {
		t.Fatalf("the promoted standby's rows: %s", got)
	}
}

func show(t *testing.T, c *Cluster, sql string) string {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var s string
	if err := conn.QueryRow(context.Background(), sql).Scan(&s); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return s
}

func run(t *testing.T, c *Cluster, sql string) {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(context.Background(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}
