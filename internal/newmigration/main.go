// Command newmigration starts the next numbered goose migration of idem
// from the current definitions of the objects it names, as sql/schema/
// holds them (`make schema` writes those files from the migrations):
//
//	go run ./internal/newmigration NAME OBJECT...
//	make migration NAME=claim_wait OBJECTS="idem.claim idem.complete"
//
// It writes sql/migrations/NNNNN_idem_NAME.sql, NNNNN the highest version
// there plus one. Its Up holds each named routine's or view's definition
// (CREATE OR REPLACE, with its comment and grants) to edit; its Down holds
// the same definitions, which restore the objects as they are now. A table,
// index, trigger or sequence cannot be replaced whole: its definition is
// written as a comment in both sections, for the ALTER statements the
// author writes. docs/contributing.md says what comes next (the upgrade
// test, `make schema`).
package main

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"

	"github.com/idemkit/idem/internal/schemadump"
)

func main() {
	migrations := flag.String("migrations", "sql/migrations", "the directory of the migrations")
	schema := flag.String("schema", "sql/schema", "the directory of the current definitions (make schema)")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: newmigration [flags] NAME OBJECT...\n\nNAME: lower-case letters, digits and _ (the file is NNNNN_idem_NAME.sql).\nOBJECT: idem.claim, claim, or a file of sql/schema (functions/claim.sql).")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() < 2 {
		flag.Usage()
		os.Exit(2)
	}
	path, err := Write(*migrations, *schema, flag.Arg(0), flag.Args()[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("wrote %s: edit its Up; its Down restores the objects as they are.\nThen: add its upgrade test in migrate/, run `make schema` and commit both.\n", path)
}

var validName = regexp.MustCompile(`^[a-z0-9_]{1,60}$`)

// ErrUnknownObject: an object named is not in sql/schema/.
var ErrUnknownObject = errors.New("newmigration: no such object in sql/schema (run `make schema` if it is new)")

// Write writes the next migration under migrationsDir from the files of
// schemaDir and returns its path.
func Write(migrationsDir, schemaDir, name string, objects []string) (string, error) {
	if !validName.MatchString(name) {
		return "", fmt.Errorf("newmigration: name %q: use lower-case letters, digits and _ (at most 60)", name)
	}
	version, err := nextVersion(migrationsDir)
	if err != nil {
		return "", err
	}
	files, err := schemadump.Read(schemaDir)
	if err != nil {
		return "", fmt.Errorf("newmigration: read %s: %w", schemaDir, err)
	}
	var replaceable, fixed []string // file paths
	seen := map[string]bool{}
	for _, o := range objects {
		path, err := find(files, o)
		if err != nil {
			return "", err
		}
		if seen[path] {
			continue
		}
		seen[path] = true
		switch strings.SplitN(path, "/", 2)[0] {
		case "functions", "procedures", "views":
			replaceable = append(replaceable, path)
		default:
			fixed = append(fixed, path)
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "-- idem %d: TODO say what this migration changes, and why.\n--\n", version)
	fmt.Fprintf(&b, "-- Started by `make migration` from sql/schema (%s).\n", strings.Join(append(append([]string{}, replaceable...), fixed...), ", "))
	b.WriteString("-- Up: today's definitions, to edit. Down: the same definitions, which restore\n" +
		"-- the objects as they are before this migration (leave them as they are; if\n" +
		"-- Up changes a routine's arguments or result, Down must first DROP the new\n" +
		"-- one, and Up must DROP the old one: CREATE OR REPLACE cannot change them).\n\n")
	for _, section := range []string{"Up", "Down"} {
		b.WriteString("-- +goose " + section + "\n")
		for _, path := range fixed {
			fmt.Fprintf(&b, "-- %s as it is (%s); write the ALTER statements here:\n", path, section)
			for _, line := range strings.Split(strings.TrimRight(files[path], "\n"), "\n") {
				b.WriteString(strings.TrimRight("-- "+line, " ") + "\n")
			}
			b.WriteString("\n")
		}
		for _, path := range replaceable {
			b.WriteString(statements(files[path]))
			b.WriteString("\n")
		}
	}
	out := filepath.Join(migrationsDir, fmt.Sprintf("%05d_idem_%s.sql", version, name))
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return "", fmt.Errorf("newmigration: %w", err)
	}
	if _, err := f.WriteString(strings.TrimRight(b.String(), "\n") + "\n"); err != nil {
		f.Close()
		return "", err
	}
	return out, f.Close()
}

// nextVersion is one more than the highest NNNNN_*.sql in dir.
func nextVersion(dir string) (int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return 0, fmt.Errorf("newmigration: %w", err)
	}
	var v int64
	for _, e := range entries {
		num, _, ok := strings.Cut(e.Name(), "_")
		if n, err := strconv.ParseInt(num, 10, 64); ok && err == nil && strings.HasSuffix(e.Name(), ".sql") {
			v = max(v, n)
		}
	}
	return v + 1, nil
}

// find maps an object's name (idem.claim, claim, functions/claim.sql,
// processed_events.processed_events_done for a trigger) to its file.
func find(files map[string]string, object string) (string, error) {
	if _, ok := files[object]; ok {
		return object, nil
	}
	name := strings.TrimPrefix(object, "idem.")
	var found []string
	for path := range files {
		base := strings.TrimSuffix(filepath.Base(path), ".sql")
		if base == name || strings.HasSuffix(base, "."+name) {
			found = append(found, path)
		}
	}
	sort.Strings(found)
	switch len(found) {
	case 0:
		return "", fmt.Errorf("%w: %q", ErrUnknownObject, object)
	case 1:
		return found[0], nil
	}
	return "", fmt.Errorf("newmigration: %q names %s: give the file", object, strings.Join(found, " and "))
}

// statements returns a file of sql/schema as goose statements: each
// routine's definition between StatementBegin and StatementEnd (its body
// holds semicolons), the one-line COMMENT and GRANT statements as they are.
func statements(file string) string {
	var b strings.Builder
	in := false
	var end string
	for _, line := range strings.Split(strings.TrimRight(file, "\n"), "\n") {
		if !in && (strings.HasPrefix(line, "CREATE OR REPLACE ") || strings.HasPrefix(line, "CREATE VIEW ") || strings.HasPrefix(line, "CREATE MATERIALIZED VIEW ")) {
			in = true
			end = bodyEnd(file, line)
			b.WriteString("-- +goose StatementBegin\n")
		}
		b.WriteString(line + "\n")
		if in && strings.HasSuffix(line, end) {
			in = false
			b.WriteString("-- +goose StatementEnd\n")
		}
	}
	return b.String()
}

// bodyEnd is how the definition that starts with line ends: the dollar
// quote pg_get_functiondef closes its body with, then ";".
func bodyEnd(file, line string) string {
	for _, tag := range []string{"$function$", "$procedure$"} {
		if strings.Contains(file, tag) && !strings.HasPrefix(line, "CREATE VIEW") {
			return tag + ";"
		}
	}
	return ";"
}
