package docs

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idemkit/idem/testpg"
)

// TestReceiverOutsideTheRepository: the receiver test docs/http.md shows
// runs as a user would run it, in a module of its own outside the
// repository's workspace (GOWORK=off) that imports only idem's public
// packages (testpg for the database, idemhttp and idemhttp/idemtest): the
// module docs/testdata/receiver, copied with its replace directives pointed
// at this checkout, and docs/http.md's two Go blocks (TestMain and
// newTestPool; TestStripeWebhookRunsOnce) as its test file. It uses this
// process's PostgreSQL server through IDEM_TEST_DATABASE_URL.
func TestReceiverOutsideTheRepository(t *testing.T) {
	t.Parallel()
	repo, err := filepath.Abs(root)
	if err != nil {
		t.Fatal(err)
	}
	src := filepath.Join(repo, "docs", "testdata", "receiver")
	dir := t.TempDir()
	for _, name := range []string{"go.mod", "go.sum", "handler_test.go"} {
		b, err := os.ReadFile(filepath.Join(src, name))
		if err != nil {
			t.Fatal(err)
		}
		if name == "go.mod" {
			s := strings.ReplaceAll(string(b), "=> ../../../idemhttp", "=> "+filepath.Join(repo, "idemhttp"))
			b = []byte(strings.ReplaceAll(s, "=> ../../..\n", "=> "+repo+"\n"))
		}
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	head, err := os.ReadFile(filepath.Join(src, "receiver_test.go.head"))
	if err != nil {
		t.Fatal(err)
	}
	doc, err := os.ReadFile(filepath.Join(repo, "docs", "http.md"))
	if err != nil {
		t.Fatal(err)
	}
	test := string(head)
	found := 0
	for _, m := range regexp.MustCompile("(?ms)^```go\n(.*?)^```").FindAllStringSubmatch(string(doc), -1) {
		if strings.Contains(m[1], "testpg.Main(m)") || strings.Contains(m[1], "func TestStripeWebhookRunsOnce(") {
			test += "\n" + m[1]
			found++
		}
	}
	if found != 2 {
		t.Fatalf("docs/http.md has %d of the receiver test's two Go blocks (TestMain with testpg.Main, TestStripeWebhookRunsOnce)", found)
	}
	if strings.Contains(test, "/internal/") {
		t.Fatal("the receiver test imports an internal package: a user cannot")
	}
	if err := os.WriteFile(filepath.Join(dir, "receiver_test.go"), []byte(test), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "test", "-count=1", "-v", "-run", "TestStripeWebhookRunsOnce", ".")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=readonly", testpg.EnvURL+"="+testpg.AdminURL())
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestStripeWebhookRunsOnce") {
		t.Fatalf("go test in a module outside the workspace: %v\n%s\n(if a dependency changed: GOWORK=off go mod tidy in docs/testdata/receiver, with receiver_test.go.head and the blocks as receiver_test.go)", err, out)
	}
}
