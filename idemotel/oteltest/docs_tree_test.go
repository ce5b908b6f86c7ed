package oteltest_test

import (
	"flag"
	"os"
	"strings"
	"sync"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the span trees in docs/observability.md")

// The span trees of docs/observability.md are the ones the tests record:
// each test checks its tree against the document (and rewrites it with
// -update), so that the document cannot drift from what idem emits.
const treesDoc = "../../docs/observability.md"

var docMu sync.Mutex

// writeTree checks (or, with -update, writes) the tree named name in the
// document, between "<!-- tree: name -->" and "<!-- end tree -->".
func writeTree(t *testing.T, name, tree string) {
	t.Helper()
	docMu.Lock()
	defer docMu.Unlock()
	b, err := os.ReadFile(treesDoc)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	open := "<!-- tree: " + name + " -->\n"
	i := strings.Index(doc, open)
	if i < 0 {
		t.Fatalf("%s has no %q", treesDoc, strings.TrimSpace(open))
	}
	j := strings.Index(doc[i:], "<!-- end tree -->")
	if j < 0 {
		t.Fatalf("%s: tree %q is not closed", treesDoc, name)
	}
	want := open + "```text\n" + tree + "```\n"
	if doc[i:i+j] == want {
		return
	}
	if !*update {
		t.Fatalf("docs/observability.md's %q tree is not what the test recorded (go test ./idemotel/oteltest -run %s -update):\n%s", name, t.Name(), tree)
	}
	if err := os.WriteFile(treesDoc, []byte(doc[:i]+want+doc[i+j:]), 0o644); err != nil {
		t.Fatal(err)
	}
}
