package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/partition"
)

func init() { register(newPartitionsCmd) }

type rotateFlags struct {
	cfg          partition.Config
	failIfLocked bool
}

// register adds rotation's flags; prefix names them apart where prune's
// flags are registered too (idemctl run: --rotate-lock-ttl).
func (r *rotateFlags) register(fs *pflag.FlagSet, prefix string) {
	optInt(fs, &r.cfg.Premake, "premake", partition.DefaultPremake, "months after the current one that must have a partition, 0 to 24")
	fs.BoolVar(&r.cfg.KeepDetached, "keep-detached", false, "retire months by DETACH (keep the table) instead of DROP")
	fs.BoolVar(&r.cfg.MoveDefault, "move-default", false, "move the rows that landed in the default partition into partitions of their months (claims of those months wait while a month's rows are copied)")
	optInt64(fs, &r.cfg.MaxMoveRows, "max-move-rows", "50000", "with --move-default: leave a month with more rows than this in the default partition")
	optInt(fs, &r.cfg.Retries, "retries", partition.DefaultRetries, "retries of a step that timed out on a lock (doubling backoff); 0: none")
	optDuration(fs, &r.cfg.Backoff, "backoff", partition.DefaultBackoff.String(), "first pause before a retry; 0: none")
	optDuration(fs, &r.cfg.LockTTL, prefix+"lock-ttl", "the database's, idem.lock_ttl('rotate'): 10m", "lease of the rotate lock")
}

func newPartitionsCmd(a *app) *cobra.Command {
	var r rotateFlags
	cmd := &cobra.Command{
		Use:   "partitions rotate|list",
		Short: "monthly partitions: rotate (premake, retire; --move-default: move default-partition rows into their months) | list",
		Example: `  idemctl partitions rotate --premake 3
  idemctl partitions list --json`,
		Args: cobra.ArbitraryArgs,
		RunE: needSubcommand,
	}
	rotate := &cobra.Command{
		Use:     "rotate",
		Short:   "premake months and retire expired ones; with --move-default, move the default partition's rows into their months",
		Example: "  idemctl partitions rotate\n  idemctl partitions rotate --move-default --max-move-rows 100000\n  idemctl partitions rotate --premake 6 --keep-detached --fail-if-locked",
		Args:    noArgs("partitions rotate"),
		RunE: func(c *cobra.Command, _ []string) error {
			if err := refuseFlags(c, "json"); err != nil {
				return err
			}
			return a.runPartitions("rotate", r, false)
		},
	}
	// Rotation's flags are the group's, so that they may come before the
	// subcommand too (partitions --premake 3 rotate).
	r.register(cmd.PersistentFlags(), "")
	var asJSON bool
	cmd.PersistentFlags().BoolVar(&r.failIfLocked, "fail-if-locked", false, "rotate: exit 4 instead of 0 when another instance holds the lock")
	cmd.PersistentFlags().BoolVar(&asJSON, "json", false, "list: print JSON")
	list := &cobra.Command{
		Use:     "list",
		Short:   "the partitions, their months, estimated rows and size",
		Example: "  idemctl partitions list\n  idemctl partitions list --json",
		Args:    noArgs("partitions list"),
		RunE: func(c *cobra.Command, _ []string) error {
			if err := refuseFlags(c, "premake", "keep-detached", "move-default", "max-move-rows", "retries", "backoff", "lock-ttl", "fail-if-locked"); err != nil {
				return err
			}
			return a.runPartitions("list", r, asJSON)
		},
	}
	cmd.AddCommand(rotate, list)
	return cmd
}

func (a *app) runPartitions(sub string, r rotateFlags, asJSON bool) error {
	ctx, io, g := a.ctx, a.io, &a.g
	if sub == "rotate" {
		r.cfg.LockTimeout, r.cfg.StatementTimeout = g.timeouts()
		if err := r.cfg.Validate(); err != nil {
			return configErr(err, rotateFlagNames(""))
		}
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
	if sub == "list" {
		return listPartitions(ctx, io, pool, asJSON)
	}
	r.cfg.Logger = log
	res, err := partition.Rotate(ctx, pool, r.cfg)
	if errors.Is(err, partition.ErrInvalidConfig) {
		// The database's bounds (idem.check_rotate_args): a usage error.
		return configErr(err, rotateFlagNames(""))
	}
	if res != nil {
		reportRotate(io, res, err)
	}
	if errors.Is(err, partition.ErrLockLost) {
		return withCode(ExitLocked, err)
	}
	if err != nil && !errors.Is(err, partition.ErrIncomplete) {
		return err
	}
	if res.Skipped && r.failIfLocked {
		return withCode(ExitLocked, errors.New("another rotation holds the lock"))
	}
	return err
}

// reportRotate prints what a rotation did; "up to date" only when it ran
// to its end (err nil) with nothing to do, not when it stopped early.
func reportRotate(io IO, res *partition.Result, err error) {
	if res.Skipped {
		fmt.Fprintf(io.Out, "skipped: another rotation (%s) holds the lock until %s\n",
			res.Holder.Holder, res.Holder.ExpiresAt.UTC().Format(time.RFC3339))
		return
	}
	if len(res.Steps) == 0 && err == nil {
		fmt.Fprintln(io.Out, "partitions are up to date")
	}
	for _, s := range res.Steps {
		fmt.Fprintf(io.Out, "%-7s %-40s %s\n", s.Action, s.Target, s.Result)
	}
}

type partitionJSON struct {
	Name       string  `json:"name"`
	Default    bool    `json:"default"`
	From       *string `json:"from,omitempty"`
	To         *string `json:"to,omitempty"`
	EstRows    int64   `json:"estimated_rows"`
	TotalBytes int64   `json:"total_bytes"`
	// Detached: a month detached from processed_events, kept
	// (--keep-detached) or, with DropPending, to be dropped by the next
	// rotation.
	Detached    bool `json:"detached,omitempty"`
	DropPending bool `json:"drop_pending,omitempty"`
}

func listPartitions(ctx context.Context, io IO, pool *pgxpool.Pool, asJSON bool) error {
	parts, err := partition.List(ctx, pool)
	if err != nil {
		return err
	}
	out := partitionRows(parts)
	// Detached months too: kept with --keep-detached, or waiting for a
	// rotation to drop them.
	detached, err := pgxdb.New(pool).DetachedMonths(ctx)
	if err != nil {
		return err
	}
	for _, d := range detached {
		out = append(out, partitionJSON{Name: d.Name, Detached: true, DropPending: d.DropPending})
	}
	if asJSON {
		enc := json.NewEncoder(io.Out)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	tw := tabwriter.NewWriter(io.Out, 0, 0, 2, ' ', 0)
	printPartitions(tw, out)
	return tw.Flush()
}

func partitionRows(parts []partition.Partition) []partitionJSON {
	out := make([]partitionJSON, 0, len(parts))
	for _, p := range parts {
		j := partitionJSON{Name: p.Name, Default: p.IsDefault, EstRows: p.EstRows, TotalBytes: p.TotalBytes}
		if p.MonthFrom.Valid {
			f, t := p.MonthFrom.Time.Format("2006-01-02"), p.MonthTo.Time.Format("2006-01-02")
			j.From, j.To = &f, &t
		}
		out = append(out, j)
	}
	return out
}

func printPartitions(tw *tabwriter.Writer, rows []partitionJSON) {
	fmt.Fprintln(tw, "PARTITION\tFROM\tTO\tEST. ROWS\tSIZE")
	for _, p := range rows {
		from, to := "(default)", ""
		switch {
		case p.DropPending:
			from = "(detached, drop pending)"
		case p.Detached:
			from = "(detached)"
		}
		if p.From != nil {
			from, to = *p.From, *p.To
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", p.Name, from, to, human(p.EstRows), bytesHuman(p.TotalBytes))
	}
}

func bytesHuman(b int64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%d B", b)
	}
	div, exp := int64(unit), 0
	for n := b / unit; n >= unit; n /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(b)/float64(div), "KMGTPE"[exp])
}
