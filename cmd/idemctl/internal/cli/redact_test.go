package cli

import (
	"bytes"
	"context"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testdb"
)

// TestPasswordNeverPrinted runs the built binary as a user does, for
// every command that takes a connection string, with the password in a
// URL and in a key=value string, pointing at an unreachable host, at the
// real server with a user it refuses, and malformed; given before the
// command, between the command and its subcommand, after them, in
// --flag=value form, with one dash, and in DATABASE_URL. The password is
// never on stdout or stderr.
func TestPasswordNeverPrinted(t *testing.T) {
	t.Parallel()
	bin := binary(t)
	const pw = "s3cr3tPW_9f1"
	cc, err := pgx.ParseConfig(testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	real := url.URL{Scheme: "postgres", User: url.UserPassword("nobody_here", pw), Path: "/" + cc.Database,
		RawQuery: url.Values{"host": {cc.Host}, "port": {fmt.Sprint(cc.Port)}}.Encode()}
	dsns := map[string]string{
		"unreachable URL":       "postgres://u:" + pw + "@127.0.0.1:1/db?connect_timeout=2",
		"unreachable key=value": "host=127.0.0.1 port=1 user=u password=" + pw + " dbname=db connect_timeout=2",
		"refused URL":           real.String(),
		"refused key=value":     fmt.Sprintf("host=%s port=%d user=nobody_here password=%s dbname=%s", cc.Host, cc.Port, pw, cc.Database),
		"malformed URL":         "postgres://u:" + pw + "@[::1",
		"quoted key=value":      "host=127.0.0.1 port=1 password='" + pw + " with space' connect_timeout=2",
	}
	commands := [][]string{
		{"migrate", "up"}, {"migrate", "down"}, {"migrate", "status"}, {"migrate", "version"},
		{"prune"}, {"partitions", "rotate"}, {"partitions", "list"}, {"run", "--listen", ""},
		{"stats"}, {"check"}, {"grant", "--app", "someone"}, {"inbox", "list"}, {"inbox", "replay", "--source", "s"},
		{"release", "--source", "s", "--key", "k"}, {"adopt", "--table", "t", "--source", "s", "--key-column", "k", "--at-column", "a"},
		{"demo", "--timeouts=false"},
	}
	for dname, dsn := range dsns {
		for _, cmd := range commands {
			forms := map[string]struct {
				args []string
				env  string
			}{
				"before":        {append([]string{"--database-url", dsn}, cmd...), ""},
				"before, =":     {append([]string{"--database-url=" + dsn}, cmd...), ""},
				"after":         {append(append([]string{}, cmd...), "--database-url", dsn), ""},
				"after, -flag=": {append(append([]string{}, cmd...), "-database-url="+dsn), ""},
				"DATABASE_URL":  {cmd, dsn},
			}
			if len(cmd) > 1 && !strings.HasPrefix(cmd[1], "-") {
				forms["between"] = struct {
					args []string
					env  string
				}{append([]string{cmd[0], "--database-url", dsn}, cmd[1:]...), ""}
			}
			for fname, f := range forms {
				t.Run(fmt.Sprintf("%s/%s/%s", dname, strings.Join(cmd, " "), fname), func(t *testing.T) {
					ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
					defer cancel()
					c := exec.CommandContext(ctx, bin, f.args...)
					c.Env = append(os.Environ(), "DATABASE_URL="+f.env, "PGCONNECT_TIMEOUT=2")
					var out, errw bytes.Buffer
					c.Stdout, c.Stderr = &out, &errw
					err := c.Run()
					if err == nil {
						t.Fatalf("exit 0 against a database it cannot use\n%s%s", out.String(), errw.String())
					}
					if strings.Contains(out.String()+errw.String(), pw) {
						t.Fatalf("the password was printed:\nstdout: %s\nstderr: %s", out.String(), errw.String())
					}
				})
			}
		}
	}
}

// TestNonsenseRefused: negative and out-of-range numbers are usage errors
// (exit 2) before anything runs, and leave the schema's version as it
// was; flags are taken on either side of a subcommand; a schema one
// version behind this build is exit 6 with the command to run.
func TestNonsenseRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	env := map[string]string{"DATABASE_URL": url}
	version := func() string {
		r := idemctl(t, ctx, env, "migrate", "version")
		return strings.TrimSpace(r.out)
	}
	before := version()
	for _, args := range [][]string{
		{"migrate", "down", "--to", "-3"},
		{"migrate", "--to", "-3", "down"},
		{"migrate", "down", "--to=-1"},
		{"migrate", "up", "--to", "-1"},
		{"migrate", "status", "--to", "2"},
		{"inbox", "list", "--limit", "-1"},
		{"inbox", "list", "--limit", "0"},
		{"check", "--max-stuck", "-1"},
		{"demo", "--events", "-5"},
	} {
		if r := idemctl(t, ctx, env, args...); r.code != ExitUsage {
			t.Errorf("%v: exit %d, want %d\n%s%s", args, r.code, ExitUsage, r.out, r.errout)
		}
	}
	if after := version(); after != before {
		t.Fatalf("the schema went from version %s to %s", before, after)
	}
	// Flags on either side of the subcommand, global ones included.
	for _, args := range [][]string{
		{"--database-url", url, "migrate", "version"},
		{"migrate", "--database-url", url, "version"},
		{"migrate", "--log-format", "json", "--lock-timeout", "1s", "version"},
		{"partitions", "--json", "list"},
		{"partitions", "--database-url=" + url, "list", "--json"},
		{"inbox", "--source", "s", "list"},
		{"--statement-timeout", "1m", "inbox", "list", "--limit", "5"},
	} {
		if r := idemctl(t, ctx, env, args...); r.code != ExitOK {
			t.Errorf("%v: exit %d\n%s%s", args, r.code, r.out, r.errout)
		}
	}
	// One version behind this build.
	if r := idemctl(t, ctx, env, "migrate", "down"); r.code != ExitOK {
		t.Fatalf("migrate down: %d %s", r.code, r.errout)
	}
	for _, args := range [][]string{{"stats"}, {"check"}, {"prune"}, {"inbox", "list"}, {"partitions", "list"}} {
		r := idemctl(t, ctx, env, args...)
		if r.code != ExitNotMigrated || !strings.Contains(r.errout, "run `idemctl migrate up`") || !strings.Contains(r.errout, "needs version") {
			t.Errorf("%v one version behind: exit %d, want %d\n%s", args, r.code, ExitNotMigrated, r.errout)
		}
	}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != ExitOK {
		t.Fatalf("migrate up: %d %s", r.code, r.errout)
	}
}
