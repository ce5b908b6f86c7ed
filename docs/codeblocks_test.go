package docs

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// root is the repository's root, from this package's directory.
const root = ".."

// normalize drops blank lines and each line's indentation, so a block
// indented inside a function still matches.
func normalize(s string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

var goBlock = regexp.MustCompile("(?ms)^```go\n(.*?)^```")

// TestCodeBlocks: every Go code block of README.md, docs/*.md and the
// examples' READMEs is held, line for line, by a Go file of the repository
// (snippets_test.go here, an Example, or the example's own source), so
// none is a sketch that no longer compiles. A block that starts with
// `package` is a whole program and must be a whole Go file (for example
// docs/snippets/migrateup), so that it compiles exactly as shown: its
// imports, the database/sql driver's included, and its error handling.
func TestCodeBlocks(t *testing.T) {
	t.Parallel()
	var sources, files []string
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata" || strings.HasPrefix(d.Name(), ".")) && path != root {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(path, ".go") {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			sources = append(sources, "\n"+normalize(string(b))+"\n")
			files = append(files, normalize(string(b)))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	docs, _ := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	examples, _ := filepath.Glob(filepath.Join(root, "examples", "*", "README.md"))
	docs = append(append([]string{filepath.Join(root, "README.md")}, docs...), examples...)
	blocks := 0
	for _, doc := range docs {
		b, err := os.ReadFile(doc)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range goBlock.FindAllSubmatchIndex(b, -1) {
			blocks++
			block := normalize(string(b[m[2]:m[3]]))
			held := false
			if strings.HasPrefix(block, "package ") {
				// A whole program, imports and error handling as shown: held
				// only by a Go file that is exactly it (so the build
				// compiles it as shown, driver import included).
				held = slices.Contains(files, block)
			} else {
				for _, src := range sources {
					if strings.Contains(src, "\n"+block+"\n") {
						held = true
						break
					}
				}
			}
			if !held {
				line := 1 + strings.Count(string(b[:m[0]]), "\n")
				t.Errorf("%s:%d: this Go block is not held by any Go file: put it, line for line, in docs/snippets_test.go (or an Example) so CI compiles it", doc, line)
			}
		}
	}
	if blocks < 10 {
		t.Fatalf("found %d Go blocks in %d documents; is the root right?", blocks, len(docs))
	}
}
