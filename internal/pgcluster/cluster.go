// Package pgcluster starts a throwaway PostgreSQL cluster from the local
// server binaries (IDEM_PG_BINDIR, `pg_config --bindir`, PATH,
// /usr/lib/postgresql/*/bin), as the postgres OS user when running as root
// (PostgreSQL refuses to run as root). The test harness and `idemctl demo`
// use it; the server is a child of the calling process and dies with it.
package pgcluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// EnvBinDir names the variable that points at PostgreSQL server binaries.
const EnvBinDir = "IDEM_PG_BINDIR"

// InstallHint says how to get the server binaries.
const InstallHint = "install the PostgreSQL server (Debian/Ubuntu: apt-get install postgresql)"

// ErrNotInstalled: no PostgreSQL server binaries were found (InstallHint
// says how to get them). Any other error of Start is the server's own,
// with its log.
var ErrNotInstalled = errors.New("no PostgreSQL server binaries (initdb, postgres) found")

// errPortTaken: the server could not bind its port, which another process
// took between freePort and the server's start.
var errPortTaken = errors.New("the port was taken by another process")

// portAttempts bounds how many ports Start and Standby try when another
// process takes the one chosen before the server binds it.
const portAttempts = 5

// Cluster is a throwaway PostgreSQL cluster owned by this process.
type Cluster struct {
	BinDir  string
	Dir     string // holds data/, the socket and the log
	Port    int
	cmd     *exec.Cmd
	cred    *syscall.Credential
	exited  chan struct{}
	waitErr error
	durable bool
	// settings are passed to the server after the defaults (-c name=value),
	// so they override them; a standby inherits its primary's.
	settings []string
	// port, when set, is the only port the server is started on.
	port int
}

// URL is a keyword/value connection string for database name on the cluster,
// over the Unix socket.
func (c *Cluster) URL(database string) string {
	return fmt.Sprintf("host=%s port=%d user=postgres dbname=%s sslmode=disable", c.Dir, c.Port, database)
}

// FindBinDir locates a directory holding initdb, pg_ctl and postgres.
func FindBinDir() (string, error) {
	var candidates []string
	if d := os.Getenv(EnvBinDir); d != "" {
		candidates = append(candidates, d)
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		candidates = append(candidates, strings.TrimSpace(string(out)))
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if r, err := filepath.EvalSymlinks(p); err == nil {
			candidates = append(candidates, filepath.Dir(r))
		}
		candidates = append(candidates, filepath.Dir(p))
	}
	globbed, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(globbed, func(i, j int) bool { return versionOf(globbed[i]) > versionOf(globbed[j]) })
	candidates = append(candidates, globbed...)
	for _, d := range candidates {
		if isExec(filepath.Join(d, "initdb")) && isExec(filepath.Join(d, "postgres")) {
			return d, nil
		}
	}
	return "", fmt.Errorf("%w in %s, pg_config --bindir, PATH or /usr/lib/postgresql/*/bin", ErrNotInstalled, EnvBinDir)
}

func versionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func isExec(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// Option adjusts a cluster Start creates.
type Option func(*Cluster)

// Durable makes the cluster durable, as a production server is: fsync,
// synchronous_commit and full_page_writes on (the default is off, for
// tests). Benchmarks report their durable numbers from such a cluster.
func Durable() Option { return func(c *Cluster) { c.durable = true } }

// Setting passes name=value to the server (postgres -c), after the
// defaults Start sets, so that it overrides them (synchronous_commit,
// synchronous_standby_names). A standby inherits its primary's settings.
func Setting(name, value string) Option {
	return func(c *Cluster) { c.settings = append(c.settings, name+"="+value) }
}

// OnPort starts the server on port and no other (a failover test puts a
// new standby where the lost primary was, so that one multi-host
// connection string names every server the test ever runs). A port that
// another process holds is an error.
func OnPort(port int) Option { return func(c *Cluster) { c.port = port } }

// Start initializes and starts a cluster in a new temporary directory.
// The server is a child of this process and dies with it.
func Start(ctx context.Context, opts ...Option) (*Cluster, error) {
	bin, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	c := &Cluster{BinDir: bin}
	for _, o := range opts {
		o(c)
	}
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, errors.New("running as root, and PostgreSQL refuses to run as root, " +
				"but there is no 'postgres' OS user to run it as (the Debian postgresql package creates one)")
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		c.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	}
	c.Dir, err = os.MkdirTemp("", "idem-pg-")
	if err != nil {
		return nil, err
	}
	if c.cred != nil {
		if err := os.Chown(c.Dir, int(c.cred.Uid), int(c.cred.Gid)); err != nil {
			c.Remove()
			return nil, err
		}
	}
	data := filepath.Join(c.Dir, "data")
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		c.Remove()
		return nil, fmt.Errorf("initdb: %v\n%s", err, out)
	}
	if err := c.startOnFreePort(ctx); err != nil {
		c.Remove()
		return nil, err
	}
	return c, nil
}

// startOnFreePort starts the server on a port no process listens on. The
// port is free when freePort releases it, but another process (a test
// binary picking its own) can take it before the server binds it: then
// the server is started again on another port, up to portAttempts times.
func (c *Cluster) startOnFreePort(ctx context.Context) error {
	if c.port != 0 {
		c.Port = c.port
		return c.startServer(ctx)
	}
	var err error
	for range portAttempts {
		if c.Port, err = pickPort(); err != nil {
			return err
		}
		if err = c.startServer(ctx); !errors.Is(err, errPortTaken) {
			return err
		}
	}
	return fmt.Errorf("%d ports in a row were taken before the server could bind them: %w", portAttempts, err)
}

func (c *Cluster) waitReady(ctx context.Context, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		select {
		case <-c.exited:
			return fmt.Errorf("postgres exited during startup: %v", c.waitErr)
		default:
		}
		cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		conn, err := pgx.Connect(cctx, c.URL("postgres"))
		cancel()
		if err == nil {
			conn.Close(ctx)
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("postgres did not accept connections within %s: %w", timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startServer runs postgres on the initialized data directory and waits
// until it accepts connections.
func (c *Cluster) startServer(ctx context.Context) error {
	logf, err := os.OpenFile(filepath.Join(c.Dir, "postgres.log"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	c.exited = make(chan struct{})
	// A throwaway cluster: durability off unless Durable, room for racing
	// tests.
	durability := "off"
	if c.durable {
		durability = "on"
	}
	c.cmd = exec.Command(filepath.Join(c.BinDir, "postgres"),
		"-D", filepath.Join(c.Dir, "data"),
		"-p", strconv.Itoa(c.Port),
		"-c", "listen_addresses=127.0.0.1",
		"-c", "unix_socket_directories="+c.Dir,
		"-c", "fsync="+durability,
		"-c", "synchronous_commit="+durability,
		"-c", "full_page_writes="+durability,
		"-c", "max_connections=400",
		"-c", "max_locks_per_transaction=256",
		"-c", "shared_buffers=256MB",
		"-c", "max_pred_locks_per_transaction=256",
		"-c", "log_min_messages=warning",
	)
	for _, kv := range c.settings {
		c.cmd.Args = append(c.cmd.Args, "-c", kv)
	}
	c.cmd.Stdout, c.cmd.Stderr = logf, logf
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := c.cmd.Start(); err != nil {
		return fmt.Errorf("start postgres: %w", err)
	}
	exited := c.exited
	cmd := c.cmd
	go func() { c.waitErr = cmd.Wait(); close(exited) }()
	if err := c.waitReady(ctx, 60*time.Second); err != nil {
		c.stopServer()
		log, _ := os.ReadFile(filepath.Join(c.Dir, "postgres.log"))
		if bytes.Contains(log, []byte("could not bind IPv4 address")) || bytes.Contains(log, []byte("Address already in use")) {
			// The next attempt appends to the same log: this one's lines
			// would only confuse a later failure's reader.
			_ = os.Truncate(filepath.Join(c.Dir, "postgres.log"), 0)
			return fmt.Errorf("port %d: %w: %v", c.Port, errPortTaken, err)
		}
		return fmt.Errorf("%w\npostgres log:\n%s", err, log)
	}
	return nil
}

// stopServer shuts the server down (fast shutdown: open transactions are
// rolled back, connections dropped) and waits for it to exit.
func (c *Cluster) stopServer() { c.stop(syscall.SIGINT) }

// stop sends the postmaster sig (SIGINT: fast shutdown; SIGQUIT:
// immediate shutdown, as pg_ctl stop -m immediate, with crash recovery
// at the next start) and waits for it to exit.
func (c *Cluster) stop(sig syscall.Signal) {
	if c.cmd == nil || c.cmd.Process == nil {
		return
	}
	_ = c.cmd.Process.Signal(sig)
	select {
	case <-c.exited:
	case <-time.After(30 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.exited
	}
	c.cmd = nil
}

// Restart stops the server with a fast shutdown and starts it again on
// the same data directory and port (the reliability tests' server restart).
func (c *Cluster) Restart(ctx context.Context) error {
	c.stopServer()
	return c.startServer(ctx)
}

// Down shuts the server down as Restart does (fast shutdown) and leaves it
// down, its directory and port kept, until Up: a database outage with
// something done while it lasts (a signal sent, a command run).
func (c *Cluster) Down() { c.stopServer() }

// Up starts a server that Down shut down, on the same data directory and
// port, and waits until it accepts connections.
func (c *Cluster) Up(ctx context.Context) error { return c.startServer(ctx) }

// RestartImmediate stops the server as pg_ctl restart -m immediate does
// (every backend quits at once, no checkpoint; the next start recovers
// from the WAL) and starts it again on the same data directory and port.
func (c *Cluster) RestartImmediate(ctx context.Context) error {
	c.stop(syscall.SIGQUIT)
	return c.startServer(ctx)
}

// Crash stops the server as pg_ctl stop -m immediate does (every backend
// quits at once, no checkpoint, nothing more sent to its standbys) and
// leaves its directory: a primary lost, for a failover test. Stop or
// Remove it afterwards.
func (c *Cluster) Crash() { c.stop(syscall.SIGQUIT) }

// Promote makes a standby a primary (pg_promote, waiting up to a minute
// for the promotion to finish): it leaves recovery on a new timeline and
// accepts writes.
func (c *Cluster) Promote(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, c.URL("postgres"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	var ok bool
	if err := conn.QueryRow(ctx, `SELECT pg_catalog.pg_promote(true, 60)`).Scan(&ok); err != nil {
		return fmt.Errorf("promote: %w", err)
	}
	if !ok {
		return errors.New("promote: the standby did not finish its promotion within 60 s")
	}
	return nil
}

// Standby starts a hot standby of c: a base backup of c (pg_basebackup
// -R, streaming replication over c's socket) in a directory of its own,
// started read-only on a port of its own (or OnPort's), with c's
// settings and then opts'. Stop it before c.
func (c *Cluster) Standby(ctx context.Context, opts ...Option) (*Cluster, error) {
	s := &Cluster{BinDir: c.BinDir, cred: c.cred, durable: c.durable, settings: append([]string(nil), c.settings...)}
	for _, o := range opts {
		o(s)
	}
	var err error
	if s.Dir, err = os.MkdirTemp("", "idem-pg-standby-"); err != nil {
		return nil, err
	}
	if s.cred != nil {
		if err := os.Chown(s.Dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			s.Remove()
			return nil, err
		}
	}
	backup := exec.CommandContext(ctx, filepath.Join(c.BinDir, "pg_basebackup"),
		"-D", filepath.Join(s.Dir, "data"), "-h", c.Dir, "-p", strconv.Itoa(c.Port), "-U", "postgres",
		"-R", "-X", "stream", "--no-sync", "-c", "fast")
	backup.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	if out, err := backup.CombinedOutput(); err != nil {
		s.Remove()
		return nil, fmt.Errorf("pg_basebackup: %v\n%s", err, out)
	}
	if err := s.startOnFreePort(ctx); err != nil {
		s.Remove()
		return nil, err
	}
	return s, nil
}

// Stop shuts the server down (fast shutdown) and removes its directory.
func (c *Cluster) Stop() {
	c.stopServer()
	c.Remove()
}

// Remove deletes the cluster's directory.
func (c *Cluster) Remove() {
	if c.Dir != "" {
		_ = os.RemoveAll(c.Dir)
	}
}

// pickPort is freePort; a test replaces it to hand out a taken port.
var pickPort = freePort

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// ClockParam is the run-time parameter that ClockOverrideSQL's idem.clock()
// honours: SET idem.test_now = '2026-10-31 23:59:59Z'.
const ClockParam = "idem.test_now"

// ClockOverrideSQL replaces idem.clock() so that a session can pretend to
// live at another time. Only for throwaway databases (tests, the demo):
// production databases keep the plain clock_timestamp() version.
const ClockOverrideSQL = `
CREATE OR REPLACE FUNCTION idem.clock() RETURNS timestamptz
    LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$ SELECT coalesce(nullif(pg_catalog.current_setting('idem.test_now', true), '')::timestamptz,
                      pg_catalog.clock_timestamp()) $$`
