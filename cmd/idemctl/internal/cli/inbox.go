package cli

import (
	"encoding/json"
	"fmt"
	"github.com/spf13/cobra"
	"text/tabwriter"
	"time"

	"github.com/idemkit/idem/inbox"
)

func init() { register(newInboxCmd) }

const inboxLong = `The inbox's dead letters: events whose jobs River dead-lettered (discarded
after their last attempt, or cancelled for a permanent error).

list: them, with their last error; replay: claim each again and enqueue a
new job with its payload; an event processed meanwhile is not run again.`

func newInboxCmd(a *app) *cobra.Command {
	var f inbox.Filter
	var since string
	var asJSON, dryRun bool
	var schema, queue string
	cmd := &cobra.Command{
		Use:   "inbox list|replay",
		Short: "the inbox's dead letters: list | replay (--source S [--key K] | --since T)",
		Long:  inboxLong,
		Example: `  idemctl inbox list --source stripe --since 24h
  idemctl inbox replay --source stripe --key evt_123 --dry-run
  idemctl inbox replay --since 2026-11-01T00:00:00Z`,
		Args: cobra.ArbitraryArgs,
		RunE: needSubcommand,
	}
	pf := cmd.PersistentFlags()
	pf.StringVar(&f.Source, "source", "", "only this source (e.g. stripe)")
	pf.StringVar(&f.Key, "key", "", "only this key (with --source)")
	pf.StringVar(&since, "since", "", "only those dead-lettered since: an RFC 3339 time or a duration back from now (e.g. 24h)")
	pf.StringVar(&schema, "river-schema", "", "the schema of River's tables (default: the search_path)")
	pf.StringVar(&queue, "queue", inbox.DefaultQueue, "the inbox's River queue")
	a.completeSources(cmd, "source")
	list := &cobra.Command{
		Use:     "list",
		Short:   "list the dead letters, newest first, with their last error",
		Example: "  idemctl inbox list --source stripe --limit 20\n  idemctl inbox list --json",
		Args:    noArgs("inbox list"),
		RunE: func(c *cobra.Command, _ []string) error {
			if err := refuseFlags(c, "dry-run"); err != nil {
				return err
			}
			return a.runInbox("list", f, since, asJSON, false, schema, queue)
		},
	}
	pf.IntVar(&f.Limit, "limit", 1000, "list: at most this many")
	pf.BoolVar(&asJSON, "json", false, "list: print JSON")
	pf.BoolVar(&dryRun, "dry-run", false, "replay: list what would be replayed, change nothing")
	replay := &cobra.Command{
		Use:     "replay",
		Short:   "claim each dead letter again and enqueue a new job with its payload",
		Example: "  idemctl inbox replay --source stripe --key evt_123\n  idemctl inbox replay --since 24h --dry-run",
		Args:    noArgs("inbox replay"),
		RunE: func(c *cobra.Command, _ []string) error {
			if err := refuseFlags(c, "limit", "json"); err != nil {
				return err
			}
			r := f
			r.Limit = 0 // every dead letter the filter matches
			return a.runInbox("replay", r, since, false, dryRun, schema, queue)
		},
	}
	cmd.AddCommand(list, replay)
	return cmd
}

func (a *app) runInbox(sub string, f inbox.Filter, since string, asJSON, dryRun bool, schema, queue string) error {
	ctx, io, g := a.ctx, a.io, &a.g
	if sub == "list" && f.Limit < 1 {
		return usageErr("--limit %d must be at least 1", f.Limit)
	}
	if f.Key != "" && f.Source == "" {
		return usageErr("--key needs --source")
	}
	if since != "" {
		t, err := parseSince(since, time.Now())
		if err != nil {
			return usageErr("--since %q: %v", since, err)
		}
		f.Since = t
	}
	if sub == "replay" && f.Source == "" && f.Since.IsZero() {
		return usageErr("inbox replay needs --source (and --key) or --since: replaying every dead letter at once is not a default")
	}
	pool, err := g.connectMigrated(ctx, io.Env, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	log, err := g.logger(io.Err)
	if err != nil {
		return err
	}
	in, err := inbox.New(inbox.Config{Pool: pool, Schema: schema, Queue: queue, Logger: log})
	if err != nil {
		return usageErr("%v", err)
	}
	if sub == "list" || dryRun {
		dead, err := in.DeadLetters(ctx, f)
		if err != nil {
			return err
		}
		if asJSON {
			enc := json.NewEncoder(io.Out)
			enc.SetIndent("", "  ")
			return enc.Encode(dead)
		}
		if len(dead) == 0 {
			fmt.Fprintln(io.Out, "no dead letters")
			return nil
		}
		if dryRun {
			fmt.Fprintf(io.Out, "would replay %s dead letter(s):\n", human(int64(len(dead))))
		}
		tw := tabwriter.NewWriter(io.Out, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "JOB\tSOURCE\tKEY\tTYPE\tATTEMPTS\tSTATE\tFAILED AT\tLAST ERROR")
		for _, d := range dead {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", d.JobID, d.Source, d.Key, d.EventType, d.Attempts, d.State,
				d.FailedAt.UTC().Format("2006-01-02 15:04:05Z"), firstLine(d.LastError, 120))
		}
		return tw.Flush()
	}
	res, err := in.Replay(ctx, f)
	for _, r := range res {
		line := fmt.Sprintf("%s %s/%s (job %d)", r.Outcome, r.Source, r.Key, r.JobID)
		if r.NewJobID != 0 {
			line += fmt.Sprintf(": new job %d", r.NewJobID)
		}
		if r.Error != "" {
			line += ": " + r.Error
		}
		fmt.Fprintln(io.Out, line)
	}
	if err != nil {
		return err
	}
	if len(res) == 0 {
		fmt.Fprintln(io.Out, "no dead letters to replay")
	}
	return nil
}

// parseSince reads an RFC 3339 time, or a duration back from now.
func parseSince(s string, now time.Time) (time.Time, error) {
	if d, err := time.ParseDuration(s); err == nil {
		if d < 0 {
			return time.Time{}, fmt.Errorf("a duration back from now must not be negative")
		}
		return now.Add(-d), nil
	}
	t, err := time.Parse(time.RFC3339, s)
	if err != nil {
		return time.Time{}, fmt.Errorf("want an RFC 3339 time (2026-11-01T00:00:00Z) or a duration (24h)")
	}
	return t, nil
}

// firstLine shortens s to one line of at most n runes.
func firstLine(s string, n int) string {
	r := []rune(s)
	for i, c := range r {
		if c == '\n' || c == '\r' {
			r = r[:i]
			break
		}
	}
	if len(r) > n {
		return string(r[:n-1]) + "…"
	}
	return string(r)
}
