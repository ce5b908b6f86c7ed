package cli

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// result is what one idemctl invocation did.
type result struct {
	code        int
	out, errout string
}

// idemctl runs the CLI in-process with the given environment.
func idemctl(t *testing.T, ctx context.Context, env map[string]string, args ...string) result {
	t.Helper()
	var out, errw bytes.Buffer
	code := Main(ctx, args, &out, &errw, func(k string) string { return env[k] })
	return result{code, out.String(), errw.String()}
}

var (
	buildOnce sync.Once
	binPath   string
	buildErr  error
)

// binary builds cmd/idemctl once per test run, for tests that need real
// processes (started together, killed with SIGKILL, sent SIGTERM).
func binary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "idemctl-bin-")
		if err != nil {
			buildErr = err
			return
		}
		binPath = filepath.Join(dir, "idemctl")
		out, err := exec.Command("go", "build", "-o", binPath, "github.com/idemkit/idem/cmd/idemctl").CombinedOutput()
		if err != nil {
			buildErr = err
			binPath = string(out)
		}
	})
	if buildErr != nil {
		t.Fatalf("build idemctl: %v\n%s", buildErr, binPath)
	}
	return binPath
}

// oneLine asserts s is exactly one line mentioning want.
func oneLine(t *testing.T, s, want string) {
	t.Helper()
	s = strings.TrimSuffix(s, "\n")
	if strings.Contains(s, "\n") || !strings.Contains(s, want) {
		t.Fatalf("want one line containing %q, got:\n%s", want, s)
	}
}
