package testdb

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PgBouncer starts a PgBouncer in transaction pooling mode in front of the
// test server and returns a URL for database dbname through it, with each
// driver's defaults (pgx's and its stdlib's statement cache, which PgBouncer
// before 1.21 breaks: the library must cope; append ExecMode for idemctl
// and maintenance, which want pgx's exec mode there). The binary comes from the distribution
// package; when it is missing and the tests run as root with apt-get, it is
// installed, otherwise the test fails saying how to install it.
func PgBouncer(t testing.TB, dbname string) string {
	t.Helper()
	bin, err := pgbouncerBinary()
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	cfg, err := pgx.ParseConfig(URLFor(t, dbname))
	if err != nil {
		t.Fatal(err)
	}
	host := cfg.Host
	port := cfg.Port
	if strings.HasPrefix(host, "/") {
		// The throwaway cluster's socket: PgBouncer connects over TCP,
		// on which the cluster listens too (same port).
		host = "127.0.0.1"
	}
	// Not t.TempDir(): its parent is private to root, and PgBouncer runs as
	// the postgres user.
	dir, err := os.MkdirTemp("", "idem-pgbouncer-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	var cred *syscall.Credential
	if os.Geteuid() == 0 { // PgBouncer refuses to run as root, like PostgreSQL
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Fatalf("testdb: PgBouncer refuses to run as root and there is no postgres user: %v", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	listen := l.Addr().(*net.TCPAddr).Port
	l.Close()
	ini := fmt.Sprintf(`[databases]
%s = host=%s port=%d dbname=%s user=%s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = any
pool_mode = transaction
max_client_conn = 500
default_pool_size = 20
ignore_startup_parameters = extra_float_digits,lock_timeout,statement_timeout,application_name,idem.test_now
logfile = %s
pidfile = %s
`, dbname, host, port, cfg.Database, cfg.User, listen, filepath.Join(dir, "pgbouncer.log"), filepath.Join(dir, "pgbouncer.pid"))
	path := filepath.Join(dir, "pgbouncer.ini")
	if err := os.WriteFile(path, []byte(ini), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, path)
	var stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stderr, &stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGTERM}
	if err := cmd.Start(); err != nil {
		t.Fatalf("testdb: start pgbouncer: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	})
	url := fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", cfg.User, listen, dbname)
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		conn, err := pgx.Connect(ctx, url)
		cancel()
		if err == nil {
			conn.Close(context.Background())
			return url
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "pgbouncer.log"))
			t.Fatalf("testdb: pgbouncer did not come up: %v\n%s\n%s", err, log, stderr.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// ExecMode is the URL parameter that makes pgx use its exec mode (no named
// prepared statements), which idemctl and the maintenance packages need
// behind PgBouncer before 1.21 (docs/idemctl.md).
const ExecMode = "&default_query_exec_mode=exec"

func pgbouncerBinary() (string, error) {
	for _, p := range []string{"pgbouncer", "/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"} {
		if path, err := exec.LookPath(p); err == nil {
			return path, nil
		}
	}
	if os.Geteuid() == 0 {
		if _, err := exec.LookPath("apt-get"); err == nil {
			cmd := exec.Command("sh", "-c", "apt-get install -y -qq pgbouncer >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq pgbouncer)")
			cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
			if out, err := cmd.CombinedOutput(); err != nil {
				return "", fmt.Errorf("pgbouncer is not installed and apt-get install pgbouncer failed: %v\n%s", err, out)
			}
			if path, err := exec.LookPath("/usr/sbin/pgbouncer"); err == nil {
				return path, nil
			}
		}
	}
	return "", fmt.Errorf("pgbouncer is not installed: apt-get install pgbouncer (the PgBouncer tests need it)")
}
