// Package cli is idemctl: every command is a function of its arguments, an
// environment lookup and two writers, so tests run it in-process.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"
	"time"
)

// Exit codes. They are part of idemctl's interface (docs/idemctl.md).
const (
	ExitOK          = 0 // success, including "skipped: another instance holds the lock"
	ExitError       = 1 // an unexpected failure while running
	ExitUsage       = 2 // bad flags, arguments or configuration
	ExitUnreachable = 3 // the database cannot be reached or refused the login
	ExitLocked      = 4 // another instance holds the lock (only with --fail-if-locked)
	ExitUnhealthy   = 5 // `check` found a problem
	ExitNotMigrated = 6 // schema idem is missing or out of date: run `idemctl migrate up`
)

// exitError carries an exit code with the one-line message for the user.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageErr(format string, args ...any) error {
	return &exitError{ExitUsage, fmt.Errorf(format, args...)}
}

func withCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &exitError{code, err}
}

// Env is how the CLI reads the environment (os.Getenv in main, a map in tests).
type Env func(string) string

// IO is where a command writes: Out for its results, Err for logs and errors.
type IO struct {
	Out, Err io.Writer
	Env      Env
}

// globals are the flags every command accepts.
type globals struct {
	databaseURL      string
	logFormat        string
	lockTimeout      time.Duration
	statementTimeout time.Duration
}

func (g *globals) register(fs *flag.FlagSet) {
	fs.StringVar(&g.databaseURL, "database-url", "", "PostgreSQL connection string (default: $DATABASE_URL, then the libpq PG* variables)")
	fs.StringVar(&g.logFormat, "log-format", "text", "log format on stderr: text or json")
	fs.DurationVar(&g.lockTimeout, "lock-timeout", 2*time.Second, "lock_timeout for DDL and deletes: how long a statement may wait for a table lock (at least 1ms)")
	fs.DurationVar(&g.statementTimeout, "statement-timeout", 5*time.Minute, "statement_timeout of each maintenance transaction (0: none)")
}

// timeouts are the maintenance timeouts as the packages take them; their
// values are checked by the packages' Validate.
func (g *globals) timeouts() (lock, statement *time.Duration) {
	return new(g.lockTimeout), new(g.statementTimeout)
}

func (g *globals) logger(w io.Writer) (*slog.Logger, error) {
	switch g.logFormat {
	case "text":
		return slog.New(slog.NewTextHandler(w, nil)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, nil)), nil
	}
	return nil, usageErr("--log-format must be text or json, not %q", g.logFormat)
}

// command is one idemctl subcommand.
type command struct {
	name    string
	summary string
	run     func(ctx context.Context, io IO, g *globals, args []string) error
}

var commands = map[string]command{}

func register(c command) { commands[c.name] = c }

// Main runs idemctl with args (without the program name) and returns the
// process exit code.
func Main(ctx context.Context, args []string, out, errw io.Writer, env Env) int {
	io := IO{Out: out, Err: errw, Env: env}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		printUsage(out)
		if len(args) == 0 {
			return ExitUsage
		}
		return ExitOK
	}
	args, err := hoistGlobals(args)
	if err != nil {
		return report(errw, "", err)
	}
	cmd, ok := commands[args[0]]
	if !ok {
		return report(errw, "", usageErr("unknown command %q (run idemctl help)", args[0]))
	}
	var g globals
	return report(errw, args[0], cmd.run(ctx, io, &g, args[1:]))
}

// hoistGlobals moves global flags given before the command after it, so
// that `idemctl --database-url X prune` and `idemctl prune --database-url X`
// mean the same.
func hoistGlobals(args []string) ([]string, error) {
	if len(args) == 0 || !strings.HasPrefix(args[0], "-") {
		return args, nil
	}
	var g globals
	fs := flag.NewFlagSet("idemctl", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	g.register(fs)
	if err := fs.Parse(args); err != nil {
		return nil, usageErr("%v (global flags are --database-url, --log-format, --lock-timeout, --statement-timeout)", err)
	}
	rest := fs.Args()
	if len(rest) == 0 {
		return nil, usageErr("no command given (run idemctl help)")
	}
	leading := args[:len(args)-len(rest)]
	return append(append([]string{rest[0]}, leading...), rest[1:]...), nil
}

func report(w io.Writer, name string, err error) int {
	if err == nil {
		return ExitOK
	}
	if errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	code := ExitError
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	// Every error is redacted here, the one place they are printed: a
	// password in a URL or key=value connection string, given in any flag
	// form, position or environment variable, never reaches the terminal.
	msg := redact(strings.ReplaceAll(err.Error(), "\n", " "))
	if name == "" {
		fmt.Fprintf(w, "idemctl: %s\n", msg)
	} else {
		fmt.Fprintf(w, "idemctl %s: %s\n", name, msg)
	}
	return code
}

// flagSet is a command's flags; -h prints them to the command's output.
// Flags may come before, between or after the arguments (one parser path
// for every command: `migrate --database-url U up` and `migrate up
// --database-url U` mean the same).
type flagSet struct {
	*flag.FlagSet
	help io.Writer
	args []string // the arguments that are not flags, in order
}

// Args are the arguments that are not flags.
func (fs *flagSet) Args() []string { return fs.args }

// NArg is len(Args()).
func (fs *flagSet) NArg() int { return len(fs.args) }

// newFlagSet returns a flag set for a command that also takes the globals.
func newFlagSet(name string, cio IO, g *globals) *flagSet {
	fs := flag.NewFlagSet("idemctl "+name, flag.ContinueOnError)
	// Errors are reported in one line by report; -h prints the flags.
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	g.register(fs)
	return &flagSet{FlagSet: fs, help: cio.Out}
}

// parse parses args, flags anywhere among the arguments, and turns flag
// errors into one-line usage errors.
func (fs *flagSet) parse(args []string) error {
	var err error
	fs.args = nil
	for {
		if err = fs.Parse(args); err != nil {
			break
		}
		rest := fs.FlagSet.Args()
		if len(rest) == 0 {
			break
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			fs.args = append(fs.args, rest...) // after "--", no more flags
			break
		}
		fs.args = append(fs.args, rest[0])
		args = rest[1:]
	}
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprintf(fs.help, "Usage of %s:\n", fs.Name())
		fs.SetOutput(fs.help)
		fs.PrintDefaults()
		return err
	}
	if err != nil {
		return usageErr("%v (run %s -h)", err, fs.Name())
	}
	return nil
}

// subcommand finds a command's subcommand, its first argument that is not
// a flag, whatever flags come before it (scan knows which of them take a
// value), and returns it with the other arguments; "" when there is none.
// The caller checks it against its subcommands (report redacts what it
// echoes).
func subcommand(args []string, scan *flag.FlagSet) (string, []string) {
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			break
		}
		if strings.HasPrefix(a, "-") && a != "-" {
			name := strings.TrimLeft(a, "-")
			if strings.Contains(name, "=") {
				continue
			}
			if f := scan.Lookup(name); f != nil {
				if b, ok := f.Value.(interface{ IsBoolFlag() bool }); !ok || !b.IsBoolFlag() {
					i++ // its value
				}
			}
			continue
		}
		return a, append(append([]string(nil), args[:i]...), args[i+1:]...)
	}
	return "", args
}

// isHelp reports whether a command's first argument asks for help.
func isHelp(arg string) bool {
	switch arg {
	case "-h", "-help", "--help", "help":
		return true
	}
	return false
}

// subcommandHelp prints a command's subcommands and flags, for
// `idemctl <command> --help`.
func subcommandHelp(w io.Writer, usage string, fs *flagSet) error {
	fmt.Fprintf(w, "Usage: idemctl %s\n\nFlags:\n", usage)
	fs.SetOutput(w)
	fs.PrintDefaults()
	return flag.ErrHelp
}

func printUsage(w io.Writer) {
	fmt.Fprintln(w, "idemctl: operate idem, the Postgres-native idempotency kit")
	fmt.Fprintln(w, "\nUsage: idemctl <command> [flags]\n\nCommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-11s %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w, "\nEvery command takes --database-url (default $DATABASE_URL, then PG* variables),")
	fmt.Fprintln(w, "--log-format text|json, --lock-timeout and --statement-timeout.")
	fmt.Fprintln(w, "Exit codes: 0 ok, 1 error, 2 usage, 3 database unreachable, 4 locked, 5 unhealthy, 6 not migrated.")
}
