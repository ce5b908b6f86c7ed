package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"github.com/spf13/cobra"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
)

func init() { register(newStatsCmd) }

type sourceStats struct {
	Source     string `json:"source"`
	Keys       int64  `json:"keys"`
	Processing int64  `json:"processing"`
	Completed  int64  `json:"completed"`
	Unstored   int64  `json:"completed_result_not_stored"`
	Released   int64  `json:"released_for_retry"`
	Failed     int64  `json:"failed_permanently"`
	Duplicates int64  `json:"duplicates"`
	// DuplicateSampling is the source's policy: above 600 claims a minute
	// (idem.exact_counting_rate(), migration 19), 1 in that many
	// duplicates is counted, as that many; below it every one is; at 0
	// none is.
	DuplicateSampling int32 `json:"duplicate_sampling"`
	// DuplicatesSampled: a minute of the last 8 days (idem.activity)
	// reached that rate with DuplicateSampling above 1, so Duplicates and
	// DuplicateRate may be estimates; false: every duplicate was counted.
	DuplicatesSampled bool       `json:"duplicates_sampled"`
	DuplicateRate     float64    `json:"duplicate_rate"`
	Retried           int64      `json:"retried"`
	Stuck             int64      `json:"stuck_past_lease"`
	Expired           int64      `json:"expired_not_pruned"`
	Oldest            *time.Time `json:"oldest,omitempty"`
	Newest            *time.Time `json:"newest,omitempty"`
}

type statsOut struct {
	Sources    []sourceStats       `json:"sources"`
	Inbox      []inbox.SourceStats `json:"inbox,omitempty"`
	InboxError string              `json:"inbox_error,omitempty"`
	Partitions []partitionJSON     `json:"partitions"`
}

func newStatsCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "stats", Short: "per source: keys by status, duplicate rate, stuck leases; partition sizes", Args: cobra.ArbitraryArgs,
		Example: `  idemctl stats
  idemctl stats --json`}
	fs := cmd.Flags()
	asJSON := fs.Bool("json", false, "print JSON")
	riverSchema := fs.String("river-schema", "", "the schema of River's tables, for the inbox's counts (default: the search_path)")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if len(args) > 0 {
			return usageErr("stats takes no arguments, got %q", args)
		}
		if _, err := g.logger(io.Err); err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 2)
		if err != nil {
			return err
		}
		defer pool.Close()
		q := pgxdb.New(pool)
		rows, err := q.SourceStats(ctx)
		if err != nil {
			return err
		}
		sampled, err := sampledSources(ctx, pool)
		if err != nil {
			return err
		}
		var out statsOut
		for _, r := range rows {
			s := sourceStats{Source: r.Source, Keys: r.Keys, Processing: r.Processing, Completed: r.Completed,
				Unstored: r.Unstored, Released: r.Released, Failed: r.Failed, Duplicates: r.Duplicates, DuplicateSampling: r.DuplicateSampling, Retried: r.Retried, Stuck: r.Stuck, Expired: r.Expired}
			s.DuplicatesSampled = r.DuplicateSampling > 1 && sampled[r.Source]
			// Each key is one new delivery; every other delivery was a duplicate.
			if total := r.Keys + r.Duplicates; total > 0 {
				s.DuplicateRate = float64(r.Duplicates) / float64(total)
			}
			if r.Oldest.Valid {
				o, n := r.Oldest.Time.UTC(), r.Newest.Time.UTC()
				s.Oldest, s.Newest = &o, &n
			}
			out.Sources = append(out.Sources, s)
		}
		// The inbox's reconciliation; an error reading River's side is shown,
		// and never keeps idem's own statistics from printing.
		out.Inbox, err = inbox.Reconcile(ctx, pool, *riverSchema)
		if err != nil {
			out.InboxError = err.Error()
		}
		parts, err := q.ListPartitions(ctx)
		if err != nil {
			return err
		}
		out.Partitions = partitionRows(parts)
		if out.Sources == nil {
			out.Sources = []sourceStats{}
		}
		if *asJSON {
			enc := json.NewEncoder(io.Out)
			enc.SetIndent("", "  ")
			return enc.Encode(out)
		}
		tw := tabwriter.NewWriter(io.Out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "SOURCE\tKEYS\tPROCESSING\tCOMPLETED\tNO RESULT\tRETRY\tFAILED\tDUPLICATES\tDUP RATE\tRETRIED\tSTUCK\tEXPIRED\tOLDEST\tNEWEST")
		for _, s := range out.Sources {
			oldest, newest := "-", "-"
			if s.Oldest != nil {
				oldest, newest = s.Oldest.Format(time.DateTime), s.Newest.Format(time.DateTime)
			}
			dups, rate := s.duplicates()
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Source, human(s.Keys), human(s.Processing),
				human(s.Completed), human(s.Unstored), human(s.Released), human(s.Failed), dups, rate, human(s.Retried), human(s.Stuck), human(s.Expired), oldest, newest)
		}
		if len(out.Sources) == 0 {
			fmt.Fprintln(tw, "(no keys)")
		}
		fmt.Fprintln(tw)
		if len(out.Inbox) > 0 {
			// accepted = processed + dead-lettered + queued, per source.
			fmt.Fprintln(tw, "INBOX SOURCE\tACCEPTED\tPROCESSED\tDEAD-LETTERED\tQUEUED\tRUNNING\tRETRYING\tUNACCOUNTED\tBALANCED")
			for _, s := range out.Inbox {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%v\n", s.Source, human(s.Accepted), human(s.Processed), human(s.Dead), human(s.Queued),
					known(s.Running), known(s.Retrying), known(s.Unaccounted), s.Balanced())
			}
			fmt.Fprintln(tw)
		}
		if out.InboxError != "" {
			fmt.Fprintf(tw, "inbox: %s\n\n", out.InboxError)
		}
		printPartitions(tw, out.Partitions)
		return tw.Flush()
	}
	return cmd
}

// sampledSources are the sources with a minute of idem.activity (the
// last 8 days) at or above the rate where claims are sampled
// (dashboard.ExactRate, idem.exact_counting_rate()).
func sampledSources(ctx context.Context, pool *pgxpool.Pool) (map[string]bool, error) {
	rows, err := pool.Query(ctx, `SELECT DISTINCT a.source FROM idem.activity a
		GROUP BY a.source, a.minute HAVING sum(a.acquired + a.duplicates) >= $1`, dashboard.ExactRate)
	if err != nil {
		return nil, err
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	out := map[string]bool{}
	for _, n := range names {
		out[n] = true
	}
	return out, err
}

// duplicates prints the duplicate count and rate as what they are: exact
// when every duplicate is counted, "~" estimates with the sample rate
// when 1 in N is, "-" when none is.
func (s sourceStats) duplicates() (count, rate string) {
	switch {
	case s.DuplicateSampling <= 0:
		return "- (not counted)", "-"
	case s.DuplicateSampling == 1 || !s.DuplicatesSampled:
		return human(s.Duplicates), fmt.Sprintf("%.1f%%", 100*s.DuplicateRate)
	}
	return fmt.Sprintf("~%s (1 in %d counted)", human(s.Duplicates), s.DuplicateSampling), fmt.Sprintf("~%.1f%%", 100*s.DuplicateRate)
}

// known prints a count, or "?" for one that could not be read (-1).
func known(n int64) string {
	if n < 0 {
		return "?"
	}
	return human(n)
}
