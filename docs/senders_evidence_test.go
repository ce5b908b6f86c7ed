package docs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
)

// exportedPresets returns the name of every exported function of package
// idemhttp (its non-test files) whose only result is a Preset: the sender
// presets a user can apply.
func exportedPresets(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "idemhttp", "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	var names []string
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		file, err := parser.ParseFile(fset, f, nil, parser.SkipObjectResolution)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range file.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok || fn.Recv != nil || !fn.Name.IsExported() || fn.Type.Results == nil || len(fn.Type.Results.List) != 1 {
				continue
			}
			if id, ok := fn.Type.Results.List[0].Type.(*ast.Ident); ok && id.Name == "Preset" {
				names = append(names, fn.Name.Name)
			}
		}
	}
	sort.Strings(names)
	return names
}

// evidenceSection is the text of docs/senders.md's "Identity evidence per
// preset" section, up to the next second-level heading.
func evidenceSection(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "docs", "senders.md"))
	if err != nil {
		t.Fatal(err)
	}
	const heading = "\n## Identity evidence per preset\n"
	s := string(b)
	i := strings.Index(s, heading)
	if i < 0 {
		t.Fatalf("docs/senders.md has no %q section", strings.TrimSpace(heading))
	}
	s = s[i+len(heading):]
	if j := strings.Index(s, "\n## "); j >= 0 {
		s = s[:j]
	}
	return s
}

var (
	presetInCell = regexp.MustCompile("`([A-Z][A-Za-z]*)\\(")
	evidenceRef  = regexp.MustCompile(`\[([a-z]+-[a-z0-9-]+)\]`)
	evidenceDef  = regexp.MustCompile(`(?m)^- \[([a-z]+-[a-z0-9-]+)\] (code|docs)\b`)
)

// TestEvidenceTableCoversEveryPreset: docs/senders.md's identity evidence
// table has a row for every preset idemhttp exports (found by parsing its
// source, so a new preset without a row fails here), each row fills its
// six cells and cites evidence, except the rows that point to the
// Twilio/WooCommerce section, and every cited entry is listed under the
// table as code or docs (and every listed entry is cited).
func TestEvidenceTableCoversEveryPreset(t *testing.T) {
	t.Parallel()
	presets := exportedPresets(t)
	if len(presets) < 20 {
		t.Fatalf("found only %d presets in idemhttp (%v): the parser missed them", len(presets), presets)
	}
	sec := evidenceSection(t)
	rows := map[string]bool{}
	cited := map[string]bool{}
	for _, line := range strings.Split(sec, "\n") {
		if !strings.HasPrefix(line, "| `") {
			continue
		}
		cells := strings.Split(strings.Trim(line, "|"), " | ")
		m := presetInCell.FindStringSubmatch(cells[0])
		if m == nil {
			t.Errorf("a row names no preset: %.80s", line)
			continue
		}
		rows[m[1]] = true
		if len(cells) > 1 && strings.TrimSpace(cells[1]) == "see the Twilio/WooCommerce section" {
			continue
		}
		if len(cells) != 6 {
			t.Errorf("%s: %d cells, want 6 (preset, key source, stable, differs, signed, retry window)", m[1], len(cells))
			continue
		}
		for i, c := range cells {
			if strings.TrimSpace(c) == "" {
				t.Errorf("%s: cell %d is empty", m[1], i+1)
			}
		}
		refs := evidenceRef.FindAllStringSubmatch(line, -1)
		if len(refs) == 0 {
			t.Errorf("%s: the row cites no evidence", m[1])
		}
		for _, r := range refs {
			cited[r[1]] = true
		}
	}
	for _, p := range presets {
		if !rows[p] {
			t.Errorf("idemhttp.%s has no row in docs/senders.md, \"Identity evidence per preset\"", p)
		}
	}
	defined := map[string]bool{}
	for _, m := range evidenceDef.FindAllStringSubmatch(sec, -1) {
		if defined[m[1]] {
			t.Errorf("evidence [%s] is listed twice", m[1])
		}
		defined[m[1]] = true
	}
	for r := range cited {
		if !defined[r] {
			t.Errorf("the table cites [%s], which is not listed under it as code or docs", r)
		}
	}
	for r := range defined {
		if !cited[r] {
			t.Errorf("evidence [%s] is listed but no row cites it", r)
		}
	}
	if !slices.Contains(presets, "Mailgun") || !slices.Contains(presets, "Calendly") {
		t.Errorf("presets %v: Mailgun and Calendly are expected among them", presets)
	}
}
