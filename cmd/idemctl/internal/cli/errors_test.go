package cli

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testdb"
)

// TestBadInvocations: every bad flag, spec, URL or database gives a
// one-line actionable error and its documented exit code.
func TestBadInvocations(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	migrated := testdb.New(t)
	empty := testdb.NewEmpty(t)
	none := map[string]string{}
	cases := []struct {
		name string
		env  map[string]string
		args []string
		code int
		msg  string
	}{
		{"no command", none, nil, ExitUsage, ""},
		{"unknown command", none, []string{"frobnicate"}, ExitUsage, `unknown command "frobnicate"`},
		{"unknown flag", none, []string{"prune", "--bogus"}, ExitUsage, "unknown flag: --bogus"},
		{"bad flag value", none, []string{"prune", "--batch-size", "many"}, ExitUsage, `invalid argument "many" for "--batch-size" flag`},
		{"batch size zero", none, []string{"prune", "--database-url", migrated, "--batch-size", "0"}, ExitUsage, "--batch-size 0 is out of range (1 to 1000000)"},
		{"negative sleep", none, []string{"prune", "--database-url", migrated, "--sleep", "-1s"}, ExitUsage, "--sleep -1s is negative"},
		{"run negative batch size", none, []string{"run", "--database-url", migrated, "--batch-size", "-5"}, ExitUsage, "--batch-size -5 is out of range (1 to 1000000)"},
		{"run zero rotate lock ttl", none, []string{"run", "--database-url", migrated, "--rotate-lock-ttl", "0"}, ExitUsage, "--rotate-lock-ttl 0s is out of range (1ms to 24h)"},
		{"zero lock timeout", none, []string{"prune", "--database-url", migrated, "--lock-timeout", "0"}, ExitUsage, "--lock-timeout 0s must be at least 1ms"},
		{"zero lock timeout rotate", none, []string{"partitions", "rotate", "--database-url", migrated, "--lock-timeout", "0"}, ExitUsage, "--lock-timeout 0s is out of range (1ms to 1h)"},
		{"zero prune lock ttl", none, []string{"prune", "--database-url", migrated, "--lock-ttl", "0"}, ExitUsage, "--lock-ttl 0s is out of range (1ms to 24h)"},
		{"negative batch retries", none, []string{"prune", "--database-url", migrated, "--batch-retries", "-1"}, ExitUsage, "--batch-retries -1 is negative"},
		{"negative retries", none, []string{"partitions", "rotate", "--database-url", migrated, "--retries", "-1"}, ExitUsage, "--retries -1 is out of range (0 to 100)"},
		{"bad log format", none, []string{"stats", "--database-url", migrated, "--log-format", "xml"}, ExitUsage, "--log-format must be text or json"},
		{"stray argument", none, []string{"stats", "--database-url", migrated, "extra"}, ExitUsage, "stats takes no arguments"},
		{"bad migrate subcommand", none, []string{"migrate", "sideways"}, ExitUsage, `unknown migrate subcommand "sideways"`},
		{"bad premake", none, []string{"partitions", "rotate", "--database-url", migrated, "--premake", "-1"}, ExitUsage, "--premake -1 is out of range (0 to 24 months)"},
		{"malformed cron spec", none, []string{"run", "--database-url", migrated, "--prune-schedule", "every five minutes"}, ExitUsage, `--prune-schedule "every five minutes" is not a valid cron spec`},
		{"too many cron fields", none, []string{"run", "--database-url", migrated, "--rotate-schedule", "* * * * * * *"}, ExitUsage, "is not a valid cron spec"},
		{"bad cron time zone", none, []string{"run", "--database-url", migrated, "--prune-schedule", "CRON_TZ=Mars/Olympus 0 3 * * *"}, ExitUsage, "is not a valid cron spec"},
		{"bad @every", none, []string{"run", "--database-url", migrated, "--prune-schedule", "@every soon"}, ExitUsage, "is not a valid cron spec"},
		{"zero @every", none, []string{"run", "--database-url", migrated, "--stats-schedule", "@every 0s"}, ExitUsage, `--stats-schedule "@every 0s": an @every interval must be a whole number of seconds, at least 1s`},
		{"negative @every", none, []string{"run", "--database-url", migrated, "--prune-schedule", "@every -5m"}, ExitUsage, "at least 1s"},
		{"sub-second @every", none, []string{"run", "--database-url", migrated, "--rotate-schedule", "@every 500ms"}, ExitUsage, "at least 1s"},
		{"negative shutdown timeout", none, []string{"run", "--database-url", migrated, "--shutdown-timeout", "-1s"}, ExitUsage, "--shutdown-timeout -1s must be positive"},
		{"zero shutdown timeout", none, []string{"run", "--database-url", migrated, "--shutdown-timeout", "0"}, ExitUsage, "--shutdown-timeout 0s must be positive"},
		{"malformed URL", none, []string{"stats", "--database-url", "postgres://u:hunter2@[::1"}, ExitUsage, "invalid database URL (from --database-url)"},
		{"malformed DATABASE_URL", map[string]string{"DATABASE_URL": "postgres://%zz"}, []string{"check"}, ExitUsage, "invalid database URL (from DATABASE_URL)"},
		{"unreachable", none, []string{"stats", "--database-url", "postgres://u:hunter2@127.0.0.1:1/x?connect_timeout=2"}, ExitUnreachable, "cannot reach the database at 127.0.0.1:1: connect: connection refused"},
		{"unknown database", none, []string{"stats", "--database-url", strings.Replace(testdb.URLFor(t, "no_such_db"), "dbname=no_such_db", "dbname=no_such_db", 1)}, ExitUnreachable, `database "no_such_db" does not exist`},
		{"unknown role", none, []string{"stats", "--database-url", migrated + " user=nobody_here password=hunter2"}, ExitUnreachable, `refused login for user "nobody_here"`},
		{"not migrated", none, []string{"prune", "--database-url", empty}, ExitNotMigrated, "schema idem is not installed in this database, or is older than this idemctl: run `idemctl migrate up` first"},
		{"not migrated check", none, []string{"check", "--database-url", empty}, ExitNotMigrated, "run `idemctl migrate up` first"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// A refusal is immediate; a flag wrongly accepted by run
			// starts the daemon, which this deadline stops.
			cctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			r := idemctl(t, cctx, tc.env, tc.args...)
			if r.code != tc.code {
				t.Fatalf("exit %d, want %d\nstdout: %s\nstderr: %s", r.code, tc.code, r.out, r.errout)
			}
			if tc.msg != "" {
				oneLine(t, r.errout, tc.msg)
			}
			if strings.Contains(r.errout+r.out, "hunter2") {
				t.Fatalf("password leaked: %s", r.errout)
			}
		})
	}
}

func TestHelp(t *testing.T) {
	t.Parallel()
	r := idemctl(t, context.Background(), nil, "help")
	if r.code != ExitOK || !strings.Contains(r.out, "prune") || !strings.Contains(r.out, "Exit codes") {
		t.Fatalf("help: %+v", r)
	}
	r = idemctl(t, context.Background(), nil, "prune", "-h")
	if r.code != ExitOK || !strings.Contains(r.out, "-batch-size") {
		t.Fatalf("prune -h: %+v", r)
	}
}

// TestPasswordsNeverPrinted: a password in the database URL appears in no
// output, log line or error of any command.
func TestPasswordsNeverPrinted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t) + " password=s3cr3t-hunter2" // the test server trusts, so any password works
	for _, args := range [][]string{
		{"stats", "--database-url", url},
		{"stats", "--database-url", url, "--json"},
		{"check", "--database-url", url, "--log-format", "json"},
		{"prune", "--database-url", url, "--log-format", "json"},
		{"partitions", "rotate", "--database-url", url, "--log-format", "json"},
		{"partitions", "list", "--database-url", url},
		{"migrate", "status", "--database-url", url},
		{"stats", "--database-url", strings.Replace(url, "port=", "port=1 xport=", 1)},
		{"stats", "--database-url", "postgres://u:s3cr3t-hunter2@127.0.0.1:1/x"},
		{"stats", "--database-url", "postgres://u:s3cr3t-hunter2@[::1"},
	} {
		r := idemctl(t, ctx, nil, args...)
		if strings.Contains(r.out+r.errout, "s3cr3t-hunter2") {
			t.Errorf("%v printed the password:\n%s%s", args[:2], r.out, r.errout)
		}
	}
}

// TestHelpEverywhere: --help works for every command and subcommand, exit 0.
func TestHelpEverywhere(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	for _, args := range [][]string{
		{"--help"}, {"migrate", "--help"}, {"migrate", "-h"}, {"migrate", "up", "--help"}, {"migrate", "down", "--help"},
		{"migrate", "status", "--help"}, {"migrate", "version", "--help"},
		{"partitions", "--help"}, {"partitions", "rotate", "--help"}, {"partitions", "list", "--help"},
		{"prune", "--help"}, {"run", "--help"}, {"stats", "--help"}, {"check", "--help"}, {"grant", "--help"}, {"demo", "--help"}, {"release", "--help"}, {"adopt", "--help"},
	} {
		r := idemctl(t, ctx, nil, args...)
		if r.code != 0 || !strings.Contains(r.out, "Usage") {
			t.Errorf("%v: exit %d\nstdout: %s\nstderr: %s", args, r.code, r.out, r.errout)
		}
	}
}

// TestGrantSameRoleRefused: one role as both application and maintainer
// would let the application read every stored result.
func TestGrantSameRoleRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 1)
	role := fmt.Sprintf("idem_same_%d", time.Now().UnixNano())
	if _, err := pool.Exec(ctx, "CREATE ROLE "+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP OWNED BY "+role)
		_, _ = pool.Exec(context.Background(), "DROP ROLE "+role)
	})
	r := idemctl(t, ctx, nil, "grant", "--database-url", url, "--app", role, "--maintainer", strings.ToUpper(role))
	if r.code != ExitUsage {
		t.Fatalf("grant --app r --maintainer R: %+v", r)
	}
	oneLine(t, r.errout, "name the same role")
	var can bool
	if err := pool.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.claim(text,text,text,interval,interval,text,interval)', 'EXECUTE')`, role).Scan(&can); err != nil || can {
		t.Fatalf("the refused grant granted something: %v %v", can, err)
	}
}
