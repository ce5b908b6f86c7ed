package oteltest_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestCoreHasNoOpenTelemetry: a program that imports only the core
// package builds without any OpenTelemetry package (go list -deps of the
// program, outside the workspace): the tracer seam costs the core no
// dependency.
func TestCoreHasNoOpenTelemetry(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name, text string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("go.mod", "module example.com/coreonly\n\ngo 1.26.7\n\nrequire github.com/idemkit/idem v0.0.0-00010101000000-000000000000\n\nreplace github.com/idemkit/idem => "+root+"\n")
	write("main.go", "package main\n\nimport (\n\t\"fmt\"\n\n\t\"github.com/idemkit/idem\"\n)\n\nfunc main() { fmt.Println(idem.OpClaim, idem.Acquired) }\n")
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	tidy := exec.Command(goBin, "mod", "tidy")
	tidy.Dir, tidy.Env = dir, append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	if out, err := tidy.CombinedOutput(); err != nil {
		t.Fatalf("go mod tidy: %v\n%s", err, out)
	}
	list := exec.Command(goBin, "list", "-deps", ".")
	list.Dir, list.Env = dir, append(os.Environ(), "GOWORK=off")
	out, err := list.CombinedOutput()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, out)
	}
	deps := strings.Fields(string(out))
	if !strings.Contains(string(out), "github.com/idemkit/idem\n") || len(deps) < 10 {
		t.Fatalf("go list -deps did not list the core:\n%s", out)
	}
	for _, p := range deps {
		if strings.HasPrefix(p, "go.opentelemetry.io/") {
			t.Errorf("the core-only program depends on %s", p)
		}
	}
	t.Logf("%d packages, none of OpenTelemetry", len(deps))
}
