package docs

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"golang.org/x/mod/modfile"
)

// The facts the docs state that can be derived from the repository are
// checked against it here, so that a doc goes stale in a failing test, not
// in a reader's hands.

func read(t *testing.T, rel string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, rel))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// readmeTestCommand is the one command of README.md's Tests section.
func readmeTestCommand(t *testing.T) string {
	t.Helper()
	readme := read(t, "README.md")
	i := strings.Index(readme, "## Tests\n")
	if i < 0 {
		t.Fatal("README.md has no Tests section")
	}
	m := regexp.MustCompile("(?s)```sh\n(.*?)\n```").FindStringSubmatch(readme[i:])
	if m == nil || strings.Contains(m[1], "\n") {
		t.Fatalf("README.md's Tests section does not open with one command in a sh block")
	}
	return m[1]
}

// TestPrereqsNamed: the README names exactly the Debian packages that its
// test command checks for (scripts/prereqs' `need` lines), and .ci/run runs
// exactly the README's test command.
func TestPrereqsNamed(t *testing.T) {
	t.Parallel()
	var script []string
	for _, m := range regexp.MustCompile(`(?m)^need (?:'[^']*'|\S+) (\S+) `).FindAllStringSubmatch(read(t, "scripts/prereqs"), -1) {
		script = append(script, m[1])
	}
	if len(script) == 0 {
		t.Fatal("scripts/prereqs has no need lines")
	}
	line := regexp.MustCompile(`(?m)^The Debian packages it needs: (.*)$`).FindStringSubmatch(read(t, "README.md"))
	if line == nil {
		t.Fatal(`README.md has no line "The Debian packages it needs: ..."`)
	}
	var readme []string
	for _, m := range regexp.MustCompile("`([^`]+)`").FindAllStringSubmatch(line[1], -1) {
		readme = append(readme, m[1])
	}
	sort.Strings(script)
	sort.Strings(readme)
	if !slices.Equal(script, readme) {
		t.Errorf("README.md names %v, scripts/prereqs checks %v", readme, script)
	}

	cmd := readmeTestCommand(t)
	if !slices.Contains(strings.Split(read(t, ".ci/run"), "\n"), cmd) {
		t.Errorf(".ci/run does not run the README's test command %q on a line of its own", cmd)
	}
	if mk := read(t, "Makefile"); cmd == "make test" && !strings.Contains(mk, "\ntest:\n\tbash scripts/prereqs\n") {
		t.Errorf("make test does not check the prerequisites before the tests")
	}
}

type module struct {
	path, dir string
	requires  []string // idem's own modules, by short name
}

// short names idem's modules as the docs do: "idem" for the core, the
// last element of the path otherwise (idemctl for cmd/idemctl).
func short(path string) string {
	if path == "github.com/idemkit/idem" {
		return "idem"
	}
	return path[strings.LastIndex(path, "/")+1:]
}

// workspace is every module of go.work with the idem modules it requires.
func workspace(t *testing.T) []module {
	t.Helper()
	wf, err := modfile.ParseWork("go.work", []byte(read(t, "go.work")), nil)
	if err != nil {
		t.Fatal(err)
	}
	var mods []module
	for _, u := range wf.Use {
		dir := strings.TrimPrefix(filepath.ToSlash(u.Path), "./")
		if dir == "." || dir == "" {
			dir = "."
		}
		gomod := filepath.Join(dir, "go.mod")
		mf, err := modfile.Parse(gomod, []byte(read(t, gomod)), nil)
		if err != nil {
			t.Fatal(err)
		}
		m := module{path: mf.Module.Mod.Path, dir: dir}
		for _, r := range mf.Require {
			if strings.HasPrefix(r.Mod.Path, "github.com/idemkit/idem") {
				m.requires = append(m.requires, short(r.Mod.Path))
			}
		}
		// The core first, then the others by name, as the table lists them.
		sort.Slice(m.requires, func(i, j int) bool {
			a, b := m.requires[i], m.requires[j]
			return a == "idem" || (b != "idem" && a < b)
		})
		mods = append(mods, m)
	}
	return mods
}

// TestModulesDocumented: docs/releasing.md's table has a row per module of
// go.work with the idem modules its go.mod requires; a released module
// requires only released ones; the tagging steps tag every released module
// and bump each one's requirements; README.md names every released
// integration module.
func TestModulesDocumented(t *testing.T) {
	t.Parallel()
	rel := read(t, "docs/releasing.md")
	rows := map[string][]string{}
	for _, m := range regexp.MustCompile("(?m)^\\| `(github.com/idemkit/idem[^`]*)` \\| `([^`]*)` \\| (yes|no) \\| ([^|]*) \\|").FindAllStringSubmatch(rel, -1) {
		rows[m[1]] = []string{m[2], m[3], strings.TrimSpace(m[4])}
	}
	released := map[string]bool{}
	mods := workspace(t)
	for _, m := range mods {
		row, ok := rows[m.path]
		if !ok {
			t.Errorf("docs/releasing.md's module table has no row for %s (%s)", m.path, m.dir)
			continue
		}
		dir := m.dir + "/"
		if m.dir == "." {
			dir = "."
		}
		if row[0] != dir {
			t.Errorf("docs/releasing.md: %s is at %s, not %s", m.path, dir, row[0])
		}
		want := strings.Join(m.requires, ", ")
		if want == "" {
			want = "none"
		}
		if row[2] != want {
			t.Errorf("docs/releasing.md: %s requires %q of idem's modules, the table says %q", m.path, want, row[2])
		}
		released[short(m.path)] = row[1] == "yes"
		delete(rows, m.path)
	}
	for path := range rows {
		t.Errorf("docs/releasing.md lists %s, which is not a module of go.work", path)
	}
	readme := read(t, "README.md")
	list := regexp.MustCompile(`one module per heavy integration \(([^;]*);`).FindStringSubmatch(readme)
	if list == nil {
		t.Fatal("README.md no longer lists the integration modules (\"one module per heavy integration (...;\")")
	}
	for _, m := range mods {
		name := short(m.path)
		if !released[name] {
			continue
		}
		for _, r := range m.requires {
			if !released[r] {
				t.Errorf("released module %s requires %s, which is not released: go install of %s@version would fail", name, r, name)
			}
		}
		if name == "idem" {
			continue
		}
		if !strings.Contains(rel, "`git tag "+strings.TrimSuffix(m.dir, "/")+"/v0.9.0`") {
			t.Errorf("docs/releasing.md's tagging step does not tag %s", m.dir)
		}
		if !regexp.MustCompile(`\b` + name + `\b`).MatchString(list[1]) {
			t.Errorf("README.md's list of integration modules (%s) leaves out %s", list[1], name)
		}
	}
	bump := regexp.MustCompile(`(?s)likewise for\s+(.*?); commit`).FindStringSubmatch(rel)
	if bump == nil {
		t.Fatal("docs/releasing.md's step 1 no longer lists the modules whose requirement is bumped")
	}
	for _, m := range mods {
		for _, r := range m.requires {
			if released[short(m.path)] && r != "idem" && !strings.Contains(bump[1], "`"+r+"`") {
				t.Errorf("docs/releasing.md step 1 does not bump the requirement on %s", r)
			}
		}
	}
}

// lastDefined maps each function and procedure of schema idem to the
// migrations that define it, in order.
func lastDefined(t *testing.T) map[string][]int {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "sql", "migrations", "*.sql"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no migrations: %v", err)
	}
	def := regexp.MustCompile(`(?i)CREATE\s+(?:OR\s+REPLACE\s+)?(?:FUNCTION|PROCEDURE)\s+idem\.(\w+)`)
	out := map[string][]int{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		up := string(b)
		if i := strings.Index(up, "-- +goose Down"); i >= 0 {
			up = up[:i]
		}
		var n int
		for _, c := range filepath.Base(f) {
			if c < '0' || c > '9' {
				break
			}
			n = n*10 + int(c-'0')
		}
		for _, m := range def.FindAllStringSubmatch(up, -1) {
			name := strings.ToLower(m[1])
			if l := out[name]; len(l) == 0 || l[len(l)-1] != n {
				out[name] = append(out[name], n)
			}
		}
	}
	return out
}

// TestCurrentVersionsCited: a sentence of README.md or docs/ that says
// where a function's current version is ("current", "last defined", "last
// redefined", followed by "migration N") names the migration that last
// defines each of idem's functions it mentions.
func TestCurrentVersionsCited(t *testing.T) {
	t.Parallel()
	defs := lastDefined(t)
	docs, _ := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	docs = append(docs, filepath.Join(root, "README.md"))
	claim := regexp.MustCompile(`(?i)(current (?:versions?|definitions?|source)|last (?:re)?defined)[^.|]*?migrations? \d`)
	num := regexp.MustCompile(`\b(\d{1,3})\b`)
	name := regexp.MustCompile(`\bidem\.(\w+)\b|\b(\w+_\w+)\b`)
	for _, f := range docs {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		// A table row or a paragraph's sentence is one statement.
		for _, stmt := range regexp.MustCompile(`\n\n|\n\||\. `).Split(string(b), -1) {
			if !claim.MatchString(stmt) {
				continue
			}
			var cited []int
			for _, m := range num.FindAllStringSubmatch(stmt[claim.FindStringIndex(stmt)[0]:], -1) {
				var n int
				for _, c := range m[1] {
					n = n*10 + int(c-'0')
				}
				cited = append(cited, n)
			}
			for _, m := range name.FindAllStringSubmatch(stmt, -1) {
				fn := m[1] + m[2]
				versions, ok := defs[strings.ToLower(fn)]
				if !ok {
					continue
				}
				if last := versions[len(versions)-1]; !slices.Contains(cited, last) {
					t.Errorf("%s: %q is last defined in migration %d, but the text cites %v:\n%s", filepath.Base(f), fn, last, cited, strings.TrimSpace(stmt))
				}
			}
		}
	}
}

// signatures maps each exported function and method name of the
// repository's non-test Go files to the parameter counts it is declared
// with (-n for a variadic one taking at least n-1).
func signatures(t *testing.T) map[string][]int {
	t.Helper()
	out := map[string][]int{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fd, ok := decl.(*ast.FuncDecl)
			if !ok || !fd.Name.IsExported() {
				continue
			}
			n, variadic := 0, false
			for _, p := range fd.Type.Params.List {
				k := max(len(p.Names), 1)
				n += k
				if _, ok := p.Type.(*ast.Ellipsis); ok {
					variadic = true
				}
			}
			if variadic {
				n = -n
			}
			out[fd.Name.Name] = append(out[fd.Name.Name], n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestDocCallsMatchSignatures: a call written in the docs' prose
// (`Stale(d, age)`, `idem.New(pool, cfg)`) passes as many
// arguments as some exported function or method of that name takes, so a
// signature that changed leaves no stale call behind. Mentions by name
// alone (`Stale`) and calls with elided arguments (`Do(...)`) are not
// calls.
func TestDocCallsMatchSignatures(t *testing.T) {
	t.Parallel()
	sigs := signatures(t)
	// A call unqualified or qualified by one of idem's packages; a
	// variable's method (`p.DownTo(ctx, N-1)` on goose's Provider) may be
	// another library's.
	call := regexp.MustCompile("`(?:(?:idem|idemhttp|idemtest|inbox|migrate|testpg|idemotel|idemprom|dashboard|pgxdb|sqldb)\\.)?([A-Z]\\w*)\\(([^`()]*)\\)`")
	docs, _ := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	docs = append(docs, filepath.Join(root, "README.md"))
	for _, f := range docs {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range call.FindAllStringSubmatch(string(b), -1) {
			decls, ok := sigs[m[1]]
			if !ok || strings.Contains(m[2], "...") || strings.Contains(m[2], "…") {
				continue
			}
			args := 0
			if strings.TrimSpace(m[2]) != "" {
				args = strings.Count(m[2], ",") + 1
			}
			if !slices.ContainsFunc(decls, func(n int) bool { return n == args || (n < 0 && args >= -n-1) }) {
				t.Errorf("%s: %s passes %d arguments; %s takes %v", filepath.Base(f), m[0], args, m[1], decls)
			}
		}
	}
}

// TestNoConflictMarkers: no Markdown file of the repository keeps the
// markers of a merge conflict left unresolved (docs/performance.md kept
// three for a session: both sides' sections, the markers between them).
func TestNoConflictMarkers(t *testing.T) {
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".md") {
			return nil
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for i, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "<<<<<<< ") || strings.HasPrefix(line, ">>>>>>> ") || line == "=======" {
				rel, _ := filepath.Rel(root, path)
				t.Errorf("%s:%d: a merge conflict's marker: %q", rel, i+1, line)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
