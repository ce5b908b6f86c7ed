package cli

import (
	"errors"
	"fmt"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"os"
	"time"

	"github.com/idemkit/idem/internal/prune"
)

func init() { register(newPruneCmd) }

type pruneFlags struct {
	cfg          prune.Config
	failIfLocked bool
}

func (p *pruneFlags) register(fs *pflag.FlagSet) {
	optInt(fs, &p.cfg.BatchSize, "batch-size", prune.DefaultBatchSize, "rows deleted per batch, 1 to 1000000")
	optDuration(fs, &p.cfg.Sleep, "sleep", prune.DefaultSleep.String(), "pause between batches, jittered +-50%; 0: none")
	fs.DurationVar(&p.cfg.MaxDuration, "max-duration", 0, "stop after this long (0: until nothing is left)")
	optDuration(fs, &p.cfg.LockTTL, "lock-ttl", "the database's, idem.lock_ttl('prune'): 30s", "lease of the prune lock; a killed prune blocks the next for at most this long")
	optInt(fs, &p.cfg.Retries, "batch-retries", prune.DefaultRetries, "retries of a batch that timed out on a table lock; 0: none")
}

func newPruneCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "prune", Short: "delete expired keys in batches (one instance at a time)", Args: cobra.ArbitraryArgs,
		Example: `  idemctl prune
  idemctl prune --dry-run
  idemctl prune --batch-size 10000 --max-duration 10m --fail-if-locked`}
	fs := cmd.Flags()
	var p pruneFlags
	p.register(fs)
	fs.BoolVar(&p.failIfLocked, "fail-if-locked", false, "exit 4 instead of 0 when another instance holds the lock")
	fs.BoolVar(&p.cfg.DryRun, "dry-run", false, "report how many rows would be deleted; delete nothing")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if len(args) > 0 {
			return usageErr("prune takes no arguments, got %q", args)
		}
		p.cfg.LockTimeout, p.cfg.StatementTimeout = g.timeouts()
		if err := p.cfg.Validate(); err != nil {
			return configErr(err, pruneFlagNames)
		}
		log, err := g.logger(io.Err)
		if err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 2)
		if err != nil {
			return err
		}
		defer pool.Close()
		p.cfg.Logger = log
		if isTerminal(io.Out) {
			p.cfg.Progress = func(pr prune.Progress) {
				fmt.Fprintf(io.Out, "\rdeleted %s rows in %s batches (%s rows/s)   ", human(pr.Deleted), human(int64(pr.Batches)), humanRate(pr.Rate()))
			}
		}
		res, err := prune.Run(ctx, pool, p.cfg)
		if p.cfg.Progress != nil && res != nil && res.Batches > 0 {
			fmt.Fprintln(io.Out)
		}
		if err != nil {
			if errors.Is(err, prune.ErrLockLost) {
				return withCode(ExitLocked, err)
			}
			return err
		}
		return reportPrune(io, res, p.failIfLocked)
	}
	return cmd
}

func reportPrune(io IO, res *prune.Result, failIfLocked bool) error {
	switch {
	case res.Skipped:
		msg := fmt.Sprintf("skipped: another prune (%s) holds the lock until %s",
			res.Holder.Holder, res.Holder.ExpiresAt.UTC().Format(time.RFC3339))
		if failIfLocked {
			return withCode(ExitLocked, errors.New(msg))
		}
		fmt.Fprintln(io.Out, msg)
	case res.DryRun:
		fmt.Fprintf(io.Out, "dry run: would delete %s expired rows\n", human(res.WouldDelete))
	default:
		fmt.Fprintf(io.Out, "deleted %s expired rows in %s batches in %s (%s rows/s); stopped: %s\n",
			human(res.Deleted), human(int64(res.Batches)), res.Elapsed.Round(time.Millisecond), humanRate(res.Rate()), res.Stopped)
	}
	return nil
}

// isTerminal reports whether w is a character device (a progress line
// with \r is welcome there and noise in a log file).
func isTerminal(w any) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
