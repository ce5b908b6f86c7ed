// Package cli is idemctl: every command is a function of its arguments, an
// environment lookup and two writers, so tests run it in-process.
//
// The parsing, help, suggestions and shell completion are cobra's (the
// library the GitHub and Kubernetes CLIs are built on): one command tree
// per invocation, built by Main.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
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
	ExitDeadLetters = 7 // `check` found nothing unhealthy but dead letters (or keys a failover left in flight) wait for an operator
	ExitLeft        = 8 // `inbox replay` went through every dead letter and left some as they are (the counts say why)
)

// exitError carries an exit code with the one-line message for the user;
// a nil err exits with the code and prints nothing more.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string {
	if e.err == nil {
		return fmt.Sprintf("exit %d", e.code)
	}
	return e.err.Error()
}
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

// ranError marks an error a command's body returned; any other error out
// of cobra is a usage error (unknown command or flag, bad flag value).
type ranError struct{ err error }

func (e ranError) Error() string { return e.err.Error() }
func (e ranError) Unwrap() error { return e.err }

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

func (g *globals) register(fs *pflag.FlagSet) {
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

// app is one invocation: what every command reads.
type app struct {
	ctx context.Context
	io  IO
	g   globals
}

// commands build idemctl's top-level commands, in the order of help.
var commands []func(a *app) *cobra.Command

func register(c func(a *app) *cobra.Command) { commands = append(commands, c) }

const rootLong = `idemctl operates idem, the Postgres-native idempotency kit: migrations,
prune, partition rotation, a cron daemon with /healthz, /metrics and a
dashboard, stats, health checks and the inbox's dead letters.

Every command takes --database-url (default $DATABASE_URL, then the libpq
PG* variables), --log-format text|json, --lock-timeout and
--statement-timeout, before or after its name.

Exit codes: 0 ok, 1 error, 2 usage, 3 database unreachable, 4 locked,
5 unhealthy, 6 not migrated, 7 dead letters wait (check), 8 dead letters
left by inbox replay. See docs/idemctl.md.`

// root builds the command tree.
func (a *app) root() *cobra.Command {
	var showVersion bool
	root := &cobra.Command{
		Use:   "idemctl",
		Short: "operate idem, the Postgres-native idempotency kit",
		Long:  rootLong,
		Example: `  idemctl migrate up --database-url postgres://idem@db/app
  idemctl check
  idemctl completion bash > /etc/bash_completion.d/idemctl`,
		Args: func(c *cobra.Command, args []string) error {
			if len(args) > 0 {
				return unknownCommand(c, args[0])
			}
			return nil
		},
		RunE: func(c *cobra.Command, args []string) error {
			if showVersion {
				return a.version()
			}
			_ = c.Help()
			return &exitError{code: ExitUsage} // no command: the help, exit 2
		},
		SilenceErrors: true,
		SilenceUsage:  true,
		// Suggestions for a mistyped command: ours name them in one line.
		DisableSuggestions: true,
	}
	root.SetOut(a.io.Out)
	root.SetErr(a.io.Err)
	root.SetArgs(nil)
	a.g.register(root.PersistentFlags())
	root.Flags().BoolVar(&showVersion, "version", false, "print idemctl's version and its modules' (and with a database URL, the schema's)")
	root.SetFlagErrorFunc(func(c *cobra.Command, err error) error {
		return usageErr("%v%s (run %s --help)", err, suggestFlag(c, err), c.CommandPath())
	})
	for _, build := range commands {
		root.AddCommand(build(a))
	}
	// cobra's own help and completion commands, in idemctl's help style.
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	for _, c := range root.Commands() {
		switch c.Name() {
		case "help":
			c.Short = "help about any command"
		case "completion":
			c.Short = "shell completion for bash, zsh, fish or powershell: commands, flags, and sources from the database"
			c.Example = `  source <(idemctl completion bash)
  idemctl completion zsh > "${fpath[1]}/_idemctl"
  idemctl completion fish > ~/.config/fish/completions/idemctl.fish`
		}
	}
	wrapRun(root)
	return root
}

// wrapRun marks every command body's errors (ranError), recursively.
func wrapRun(c *cobra.Command) {
	if run := c.RunE; run != nil {
		c.RunE = func(c *cobra.Command, args []string) error {
			if err := run(c, args); err != nil {
				return ranError{err}
			}
			return nil
		}
	}
	for _, sub := range c.Commands() {
		wrapRun(sub)
	}
}

// Main runs idemctl with args (without the program name) and returns the
// process exit code.
func Main(ctx context.Context, args []string, out, errw io.Writer, env Env) int {
	a := &app{ctx: ctx, io: IO{Out: out, Err: errw, Env: env}}
	root := a.root()
	root.SetArgs(doubleDash(root, args))
	cmd, err := root.ExecuteContextC(ctx)
	return report(errw, topName(root, cmd), err)
}

// execute runs one more idemctl command line in this process (the demo
// prints the stats of its own database), with fresh flags.
func (a *app) execute(args ...string) error {
	sub := &app{ctx: a.ctx, io: a.io}
	root := sub.root()
	root.SetArgs(args)
	_, err := root.ExecuteContextC(a.ctx)
	var re ranError
	if errors.As(err, &re) {
		return re.err
	}
	return err
}

// topName is the top-level command's name, for the error line.
func topName(root, cmd *cobra.Command) string {
	if cmd == nil || cmd == root {
		return ""
	}
	for cmd.Parent() != nil && cmd.Parent() != root {
		cmd = cmd.Parent()
	}
	return cmd.Name()
}

func report(w io.Writer, name string, err error) int {
	if err == nil {
		return ExitOK
	}
	code := ExitUsage // cobra's own errors: unknown command or flag, bad value
	var re ranError
	if errors.As(err, &re) {
		code = ExitError
	}
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
		if ee.err == nil {
			return code
		}
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

// noArgs refuses arguments that are not flags, naming the command.
func noArgs(name string) cobra.PositionalArgs {
	return func(c *cobra.Command, args []string) error {
		if len(args) > 0 {
			return usageErr("%s takes no arguments, got %q", name, args)
		}
		return nil
	}
}

// unknownCommand is the error for a mistyped command or subcommand, with
// cobra's suggestions (prefix and Levenshtein distance 2).
func unknownCommand(c *cobra.Command, arg string) error {
	path := c.CommandPath()
	msg := fmt.Sprintf("unknown command %q", arg)
	if c.HasParent() {
		msg = fmt.Sprintf("unknown %s subcommand %q", strings.TrimPrefix(path, "idemctl "), arg)
	}
	c.SuggestionsMinimumDistance = 2
	if s := c.SuggestionsFor(arg); len(s) > 0 {
		return usageErr("%s: did you mean %q? (run %s --help)", msg, s[0], path)
	}
	var names []string
	for _, sub := range c.Commands() {
		if sub.IsAvailableCommand() {
			names = append(names, sub.Name())
		}
	}
	return usageErr("%s: want one of %s (run %s --help)", msg, strings.Join(names, ", "), path)
}

// needSubcommand is the body of a command that only groups subcommands.
func needSubcommand(c *cobra.Command, args []string) error {
	if len(args) > 0 {
		return unknownCommand(c, args[0])
	}
	var names []string
	for _, sub := range c.Commands() {
		if sub.IsAvailableCommand() {
			names = append(names, sub.Name())
		}
	}
	return usageErr("%s needs a subcommand: %s", c.Name(), strings.Join(names, ", "))
}

// suggestFlag is ` (did you mean --x?)` for an unknown flag close to one
// the command takes.
func suggestFlag(c *cobra.Command, err error) string {
	const prefix = "unknown flag: --"
	msg := err.Error()
	if !strings.HasPrefix(msg, prefix) {
		return ""
	}
	typed := strings.TrimPrefix(msg, prefix)
	best, bestD := "", 3
	c.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Hidden {
			return
		}
		d := distance(typed, f.Name)
		if strings.HasPrefix(f.Name, typed) && len(typed) > 2 {
			d = 1
		}
		if d < bestD || (d == bestD && best != "" && f.Name < best) {
			best, bestD = f.Name, d
		}
	})
	if best == "" {
		return ""
	}
	return fmt.Sprintf(": did you mean --%s?", best)
}

// distance is the Levenshtein distance between a and b.
func distance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// refuseFlags refuses the group's flags given that the subcommand c does
// not take: a group's flags are all defined on it, so that they may come
// before or after the subcommand (partitions --json list).
func refuseFlags(c *cobra.Command, names ...string) error {
	var bad []string
	for _, n := range names {
		if f := c.Flags().Lookup(n); f != nil && f.Changed {
			bad = append(bad, "--"+n)
		}
	}
	if len(bad) > 0 {
		return usageErr("%s does not take %s", c.CommandPath(), strings.Join(bad, ", "))
	}
	return nil
}

// doubleDash accepts the single-dash long flags of the standard flag
// package that idemctl parsed with before cobra (-database-url=U,
// -batch-size 10): an argument -name or -name=value where name is one of
// idemctl's long flags becomes --name, unless it is the value of the
// flag before it. Arguments after "--" are left alone.
func doubleDash(root *cobra.Command, args []string) []string {
	takesValue := map[string]bool{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		for _, fs := range []*pflag.FlagSet{c.LocalFlags(), c.PersistentFlags()} {
			fs.VisitAll(func(f *pflag.Flag) { takesValue[f.Name] = f.NoOptDefVal == "" })
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
	out := make([]string, len(args))
	copy(out, args)
	for i, arg := range out {
		if arg == "--" {
			break
		}
		if i > 0 {
			prev := strings.TrimLeft(out[i-1], "-")
			if strings.HasPrefix(out[i-1], "-") && !strings.Contains(prev, "=") && takesValue[prev] {
				continue // the previous flag's value
			}
		}
		if len(arg) < 3 || arg[0] != '-' || arg[1] == '-' {
			continue
		}
		name, _, _ := strings.Cut(arg[1:], "=")
		if _, known := takesValue[name]; known && len(name) > 1 {
			out[i] = "-" + arg
		}
	}
	return out
}
