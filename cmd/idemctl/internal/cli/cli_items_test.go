package cli

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// TestVersion: idemctl version and --version print the binary's and its
// modules' versions; with a database one migration behind, the database's
// schema version and the one migration `migrate up` would apply, without
// changing the database; on an empty database, that schema idem is not
// installed, and creating nothing.
func TestVersion(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, args := range [][]string{{"version"}, {"--version"}} {
		r := idemctl(t, ctx, nil, args...)
		if r.code != 0 || !strings.HasPrefix(r.out, "idemctl ") || !strings.Contains(r.out, fmt.Sprintf("this idemctl needs idem version %d", migrate.Latest())) ||
			strings.Contains(r.out, "database:") {
			t.Fatalf("%v: %+v", args, r)
		}
	}
	// The modules' versions are the build's: a binary built by go build
	// records them (a test binary records its own).
	out, err := exec.Command(binary(t), "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "modules:\n") || !strings.Contains(string(out), "github.com/jackc/pgx/v5 v5.") ||
		!strings.Contains(string(out), "github.com/spf13/cobra v1.") {
		t.Fatalf("idemctl version (built): %v\n%s", err, out)
	}

	latest := migrate.Latest()
	var last string
	entries, err := fs.ReadDir(migrate.FS(), ".")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), fmt.Sprintf("%05d_", latest)) {
			last = e.Name()
		}
	}
	url := testdb.NewEmpty(t)
	if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url, "--to", fmt.Sprint(latest-1)); r.code != 0 {
		t.Fatalf("migrate up --to %d: %+v", latest-1, r)
	}
	for _, args := range [][]string{{"version", "--database-url", url}, {"--version", "--database-url", url}} {
		r := idemctl(t, ctx, nil, args...)
		if r.code != 0 || !strings.Contains(r.out, fmt.Sprintf("database: schema idem at version %d\n", latest-1)) ||
			!strings.Contains(r.out, "migrate up would apply 1 migration(s): "+last+"\n") {
			t.Fatalf("%v one migration behind: %+v", args, r)
		}
	}
	r := idemctl(t, ctx, map[string]string{"DATABASE_URL": url}, "version")
	if r.code != 0 || !strings.Contains(r.out, fmt.Sprintf("database: schema idem at version %d\n", latest-1)) {
		t.Fatalf("version with DATABASE_URL: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "migrate", "up", "--database-url", url, "--river=false"); r.code != 0 {
		t.Fatalf("migrate up: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "version", "--database-url", url); !strings.Contains(r.out, "migrate up would apply: nothing (up to date)") {
		t.Fatalf("version up to date: %+v", r)
	}
	empty := testdb.NewEmpty(t)
	if r := idemctl(t, ctx, nil, "version", "--database-url", empty); r.code != 0 || !strings.Contains(r.out, "database: schema idem is not installed") ||
		!strings.Contains(r.out, fmt.Sprintf("migrate up would apply %d migration(s): 00001_", latest)) {
		t.Fatalf("version on an empty database: %+v", r)
	}
	var schemas int
	if err := testdb.Pool(t, empty, 1).QueryRow(ctx, `SELECT count(*) FROM pg_namespace WHERE nspname = 'idem'`).Scan(&schemas); err != nil || schemas != 0 {
		t.Fatalf("version created schema idem: %d %v", schemas, err)
	}
	if r := idemctl(t, ctx, nil, "version", "--database-url", "postgres://u:s3cr3t@127.0.0.1:1/x?connect_timeout=2"); r.code != ExitUnreachable || strings.Contains(r.out+r.errout, "s3cr3t") {
		t.Fatalf("version against an unreachable database: %+v", r)
	}
}

// TestDidYouMean: a mistyped command, subcommand or flag is a usage error
// (exit 2) that names the closest one.
func TestDidYouMean(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"prnue"}, `unknown command "prnue": did you mean "prune"?`},
		{[]string{"stat"}, `unknown command "stat": did you mean "stats"?`},
		{[]string{"migrate", "upp"}, `unknown migrate subcommand "upp": did you mean "up"?`},
		{[]string{"inbox", "replya"}, `unknown inbox subcommand "replya": did you mean "replay"?`},
		{[]string{"partitions", "rotat"}, `did you mean "rotate"?`},
		{[]string{"prune", "--batch-sise", "10"}, "unknown flag: --batch-sise: did you mean --batch-size?"},
		{[]string{"release", "--sorce", "s"}, "unknown flag: --sorce: did you mean --source?"},
		{[]string{"check", "--databse-url", "x"}, "unknown flag: --databse-url: did you mean --database-url?"},
		{[]string{"frobnicate"}, `unknown command "frobnicate": want one of`},
	} {
		r := idemctl(t, context.Background(), nil, c.args...)
		if r.code != ExitUsage {
			t.Errorf("%v: exit %d, want %d\n%s", c.args, r.code, ExitUsage, r.errout)
			continue
		}
		oneLine(t, r.errout, c.want)
	}
	// The standard flag package's single-dash long flags still work.
	r := idemctl(t, context.Background(), nil, "prune", "-batch-size", "0", "-database-url=postgres://u:s3cr3t@127.0.0.1:1/x")
	if r.code != ExitUsage || !strings.Contains(r.errout, "--batch-size 0 is out of range") || strings.Contains(r.errout, "s3cr3t") {
		t.Fatalf("single-dash long flags: %+v", r)
	}
}

// TestHumanNumbers: text output groups digits; --json is exact.
func TestHumanNumbers(t *testing.T) {
	t.Parallel()
	for n, want := range map[int64]string{0: "0", 999: "999", 5257: "5,257", 1_000_000: "1,000,000", -12345: "-12,345"} {
		if got := human(n); got != want {
			t.Errorf("human(%d) = %q, want %q", n, got, want)
		}
	}
	if got := humanRate(5256.619320344008); got != "5,257" {
		t.Errorf("humanRate = %q, want 5,257", got)
	}
}

// TestCompletionBash: the bash completion script, sourced by a real bash,
// completes a command, a subcommand, a flag, and a source from the database
// (the real binary answers bash's __complete calls).
func TestCompletionBash(t *testing.T) {
	t.Parallel()
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Fatal("bash is needed: ", err)
	}
	// As a user's shell has it (Debian's bash-completion; .ci/run installs it).
	if _, err := os.Stat("/usr/share/bash-completion/bash_completion"); err != nil {
		t.Fatal("bash-completion is needed (apt-get install bash-completion): ", err)
	}
	bin := binary(t)
	dir := t.TempDir()
	if err := os.Symlink(bin, filepath.Join(dir, "idemctl")); err != nil {
		t.Fatal(err)
	}
	script, err := exec.Command(bin, "completion", "bash").Output()
	if err != nil {
		t.Fatal(err)
	}
	scriptFile := filepath.Join(dir, "idemctl.bash")
	if err := os.WriteFile(scriptFile, script, 0o600); err != nil {
		t.Fatal(err)
	}
	url := testdb.New(t)
	if _, err := testdb.Pool(t, url, 1).Exec(context.Background(),
		`INSERT INTO idem.policies (source, ttl, lease) VALUES ('stripe', '7 days', '1 minute'), ('shopify', '7 days', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	complete := func(line string) string {
		t.Helper()
		// COMP_WORDS as bash splits the line; the cursor at its end.
		words := strings.Fields(line)
		if strings.HasSuffix(line, " ") {
			words = append(words, "")
		}
		quoted := make([]string, len(words))
		for i, w := range words {
			quoted[i] = "'" + w + "'"
		}
		prog := fmt.Sprintf(`source /usr/share/bash-completion/bash_completion
source %s
complete -p idemctl >/dev/null || { echo "no completion registered"; exit 1; }
COMP_WORDS=(%s); COMP_CWORD=%d; COMP_LINE=%q; COMP_POINT=${#COMP_LINE}; COMP_TYPE=9
__start_idemctl
printf '%%s\n' "${COMPREPLY[@]}"`, scriptFile, strings.Join(quoted, " "), len(words)-1, line)
		cmd := exec.Command(bash, "--norc", "--noprofile", "-c", prog)
		cmd.Env = append(os.Environ(), "PATH="+dir+string(os.PathListSeparator)+os.Getenv("PATH"), "DATABASE_URL="+url)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("bash: %v\n%s", err, out)
		}
		return string(out)
	}
	has := func(out string, want ...string) bool {
		lines := strings.Split(strings.TrimSpace(out), "\n")
		for _, w := range want {
			found := false
			for _, l := range lines {
				if strings.TrimSpace(l) == w {
					found = true
				}
			}
			if !found {
				return false
			}
		}
		return true
	}
	if out := complete("idemctl pru"); !has(out, "prune") {
		t.Errorf("idemctl pru<TAB>: %q", out)
	}
	if out := complete("idemctl migrate "); !has(out, "up", "down", "status", "version") {
		t.Errorf("idemctl migrate <TAB>: %q", out)
	}
	if out := complete("idemctl prune --batch"); !has(out, "--batch-size", "--batch-retries") {
		t.Errorf("idemctl prune --batch<TAB>: %q", out)
	}
	if out := complete("idemctl release --source s"); !has(out, "stripe", "shopify") {
		t.Errorf("idemctl release --source s<TAB>: %q", out)
	}
	if out := complete("idemctl inbox list --source str"); !has(out, "stripe") {
		t.Errorf("idemctl inbox list --source str<TAB>: %q", out)
	}
	// zsh and fish scripts are generated too.
	for _, sh := range []string{"zsh", "fish"} {
		if out, err := exec.Command(bin, "completion", sh).Output(); err != nil || !strings.Contains(string(out), "idemctl") {
			t.Errorf("completion %s: %v", sh, err)
		}
	}
}

// TestReleaseHeldByInbox: release of a key the inbox holds (here a dead
// letter) is refused, and the message gives the inbox replay command for
// that very key.
func TestReleaseHeldByInbox(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": url}
	if r := idemctl(t, ctx, env, "migrate", "up"); r.code != 0 {
		t.Fatalf("migrate up: %+v", r)
	}
	pool := testdb.Pool(t, url, 8)
	var handled atomic.Int64
	in, err := inbox.New(inbox.Config{Pool: pool, MaxAttempts: map[string]int{"shop": 1}, Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
		handled.Add(1)
		return nil, errors.New("no such product")
	}})
	if err != nil {
		t.Fatal(err)
	}
	// Queued (no worker yet): held by the inbox.
	if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: "order 7", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, env, "release", "--source", "shop", "--key", "order 7")
	if r.code != ExitError {
		t.Fatalf("release of a queued key: %+v", r)
	}
	oneLine(t, r.errout, "shop/order 7 is held by the inbox (a queued job or a dead letter), so release leaves it alone: if it is a dead letter, use `idemctl inbox replay --source shop --key 'order 7'`")
	// Dead-lettered: the same answer.
	rc, err := in.NewWorkerClient(2, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := rc.Start(ctx); err != nil {
		t.Fatal(err)
	}
	defer rc.Stop(ctx)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if d, _ := in.DeadLetters(ctx, inbox.Filter{}); len(d) == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no dead letter")
		}
	}
	r = idemctl(t, ctx, env, "release", "--source", "shop", "--key", "order 7")
	if r.code != ExitError || !strings.Contains(r.errout, "`idemctl inbox replay --source shop --key 'order 7'`") {
		t.Fatalf("release of a dead letter: %+v", r)
	}
}
