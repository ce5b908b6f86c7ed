// Package testnats gives tests a real NATS server with JetStream on: a
// throwaway nats-server from the local binary (Debian's package), in a
// temporary directory, on a port the server picks itself, stopped when the
// test ends. Without the binary, the test fails saying how to install it:
// a NATS test never skips.
package testnats

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// InstallHint says how to get the server binary.
const InstallHint = "install the NATS server: apt-get install nats-server (Debian/Ubuntu), or put a nats-server binary (https://github.com/nats-io/nats-server/releases) on PATH"

// Server is a running nats-server with JetStream on.
type Server struct {
	// URL is the client URL, nats://127.0.0.1:port.
	URL string

	dir    string
	cmd    *exec.Cmd
	exited chan struct{} // closed once the process has been reaped
	out    *buffer
	once   sync.Once
}

// Start starts a nats-server with JetStream on for t and stops it when t
// ends. Its store lives in a temporary directory removed afterwards.
func Start(t testing.TB) *Server {
	t.Helper()
	s, err := start()
	if err != nil {
		t.Fatalf("testnats: %v", err)
	}
	t.Cleanup(s.Stop)
	return s
}

// binaries are where Binary looks: PATH, then where packages install it.
var binaries = []string{"nats-server", "/usr/sbin/nats-server", "/usr/bin/nats-server", "/usr/local/bin/nats-server"}

// Binary finds nats-server on PATH or where Debian installs it.
func Binary() (string, error) {
	for _, p := range binaries {
		if path, err := exec.LookPath(p); err == nil {
			return path, nil
		}
	}
	return "", errors.New("nats-server is not installed: " + InstallHint)
}

func start() (*Server, error) {
	bin, err := Binary()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-nats-")
	if err != nil {
		return nil, err
	}
	// -p -1: the server binds a free port itself and writes it to the ports
	// file, so no port is picked here and raced for.
	cmd := exec.Command(bin, "-a", "127.0.0.1", "-p", "-1", "-js", "-sd", filepath.Join(dir, "store"),
		"--ports_file_dir", dir, "-l", filepath.Join(dir, "nats.log"))
	out := &buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	// The server dies with the test process, even one killed outright.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	s := &Server{dir: dir, cmd: cmd, exited: make(chan struct{}), out: out}
	go func() { _ = cmd.Wait(); close(s.exited) }()
	portsFile := filepath.Join(dir, fmt.Sprintf("%s_%d.ports", filepath.Base(bin), cmd.Process.Pid))
	deadline := time.Now().Add(30 * time.Second)
	for {
		url, err := readURL(portsFile)
		if err == nil {
			if err = jetStreamReady(url); err == nil {
				s.URL = url
				return s, nil
			}
		}
		select {
		case <-s.exited:
			log := s.log()
			os.RemoveAll(dir)
			return nil, fmt.Errorf("nats-server exited at start:\n%s", log)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			log := s.log()
			s.Stop()
			return nil, fmt.Errorf("nats-server did not come up within 30s (%v):\n%s", err, log)
		}
	}
}

// readURL reads the client URL from the ports file the server writes once
// it listens.
func readURL(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	var ports struct {
		Nats []string `json:"nats"`
	}
	if err := json.Unmarshal(b, &ports); err != nil || len(ports.Nats) == 0 {
		return "", fmt.Errorf("ports file %q not complete yet", b)
	}
	return ports.Nats[0], nil
}

// jetStreamReady connects and reads the server's INFO line, which says
// whether JetStream is on.
func jetStreamReady(url string) error {
	conn, err := net.DialTimeout("tcp", strings.TrimPrefix(url, "nats://"), 2*time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return err
	}
	var info struct {
		JetStream bool `json:"jetstream"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(strings.TrimSpace(line), "INFO ")), &info); err != nil {
		return fmt.Errorf("unexpected INFO line %q: %w", line, err)
	}
	if !info.JetStream {
		return errors.New("JetStream is not on")
	}
	return nil
}

// Stop stops the server and removes its directory (Start's cleanup does it).
func (s *Server) Stop() {
	s.once.Do(func() {
		_ = s.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-s.exited:
		case <-time.After(10 * time.Second):
			_ = s.cmd.Process.Kill()
			<-s.exited
		}
		os.RemoveAll(s.dir)
	})
}

// Log returns what the server has logged so far (for a failing test).
func (s *Server) Log() string { return s.log() }

func (s *Server) log() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "nats.log"))
	return string(b) + s.out.String()
}

// buffer is a bytes.Buffer safe for the process's writers.
type buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *buffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
