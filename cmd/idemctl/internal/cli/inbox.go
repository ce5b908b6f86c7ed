package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/idemkit/idem/inbox"
)

func init() { register(newInboxCmd) }

const inboxLong = `The inbox's dead letters: events whose jobs River dead-lettered (discarded
after their last attempt, or cancelled for a permanent error).

list: every one the filter selects, newest first, with its last error
(--limit N: the N newest, and how many more there are); replay: every one
the filter selects, oldest first, each claimed again and enqueued as a new
job with its payload; an event processed meanwhile is not run again. Both
read the dead letters page by page: no limit of their own. replay ends
with a count per outcome and exits 8 when it left dead letters as they are
(their key failed for good, or their payload is gone).`

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
		Short:   "list every dead letter the filter selects, newest first, with its last error",
		Example: "  idemctl inbox list --source stripe --limit 20\n  idemctl inbox list --json",
		Args:    noArgs("inbox list"),
		RunE: func(c *cobra.Command, _ []string) error {
			if err := refuseFlags(c, "dry-run"); err != nil {
				return err
			}
			l := f
			l.Newest = true
			if !c.Flags().Changed("limit") {
				l.Limit = 0
			} else if l.Limit < 1 {
				return usageErr("--limit %d must be at least 1 (without --limit: every one)", l.Limit)
			}
			return a.runInbox("list", l, since, asJSON, false, schema, queue)
		},
	}
	pf.IntVar(&f.Limit, "limit", 0, "list: only the newest N (default: every one)")
	pf.BoolVar(&asJSON, "json", false, "list: print JSON")
	pf.BoolVar(&dryRun, "dry-run", false, "replay: list what would be replayed, change nothing")
	replay := &cobra.Command{
		Use:   "replay",
		Short: "claim every dead letter the filter selects again (oldest first) and enqueue a new job with its payload",
		Long: `replay goes through every dead letter the filter selects, oldest first, page
by page (no limit of its own): each is claimed again and enqueued as a new job
with its payload, in one transaction. A line per dead letter, then a count per
outcome. Exit 8 when some were left as they are: their key failed for good
(past its policy's max_attempts) or their payload is gone.`,
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
		return listDead(ctx, io.Out, io.Err, in, f, asJSON, dryRun)
	}
	return replayDead(ctx, io.Out, in, f)
}

// listDead prints every dead letter f selects (a table, or a JSON array),
// read page by page; with f.Limit, it says how many it did not show.
func listDead(ctx context.Context, out, errOut io.Writer, in *inbox.Inbox, f inbox.Filter, asJSON, dryRun bool) error {
	total, err := in.CountDeadLetters(ctx, f)
	if err != nil {
		return err
	}
	if asJSON {
		dead, err := in.DeadLetters(ctx, f)
		if err != nil {
			return err
		}
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(dead); err != nil {
			return err
		}
		return notShown(errOut, total, int64(len(dead)))
	}
	if total == 0 {
		fmt.Fprintln(out, "no dead letters")
		return nil
	}
	if dryRun {
		fmt.Fprintf(out, "would replay %s dead letter(s), oldest first:\n", human(total))
	}
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "JOB\tSOURCE\tKEY\tTYPE\tATTEMPTS\tSTATE\tFAILED AT\tLAST ERROR")
	var shown int64
	err = in.EachDeadLetter(ctx, f, func(d inbox.DeadLetter) error {
		shown++
		_, err := fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", d.JobID, d.Source, d.Key, d.EventType, d.Attempts, d.State,
			d.FailedAt.UTC().Format("2006-01-02 15:04:05Z"), firstLine(d.LastError, 120))
		return err
	})
	if err != nil {
		return err
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	return notShown(errOut, total, shown)
}

// notShown says, on stderr, how many of the total dead letters a limited
// list did not show.
func notShown(errOut io.Writer, total, shown int64) error {
	if more := total - shown; more > 0 {
		fmt.Fprintf(errOut, "%s of %s dead letter(s) shown, newest first; %s older not shown (raise --limit, or leave it out to list every one)\n",
			human(shown), human(total), human(more))
	}
	return nil
}

// replayOrder is the order replay's summary names the outcomes in.
var replayOrder = []string{inbox.ReplayReplayed, inbox.ReplayAlreadyProcessed, inbox.ReplayInProgress, inbox.ReplayFailed, inbox.ReplayPayloadLost}

// replayDead replays every dead letter f selects, a line each, then a
// count per outcome; exit ExitLeft when some were left as they are.
func replayDead(ctx context.Context, out io.Writer, in *inbox.Inbox, f inbox.Filter) error {
	counts := map[string]int64{}
	var total, left int64
	err := in.ReplayEach(ctx, f, func(r inbox.ReplayResult) error {
		total++
		counts[r.Outcome]++
		if r.Left() {
			left++
		}
		line := fmt.Sprintf("%s %s/%s (job %d)", r.Outcome, r.Source, r.Key, r.JobID)
		if r.NewJobID != 0 {
			line += fmt.Sprintf(": new job %d", r.NewJobID)
		}
		if r.Error != "" {
			line += ": " + firstLine(r.Error, 300)
		}
		_, err := fmt.Fprintln(out, line)
		return err
	})
	if total == 0 && err == nil {
		fmt.Fprintln(out, "no dead letters to replay")
		return nil
	}
	parts := make([]string, 0, len(replayOrder))
	for _, o := range replayOrder {
		if n := counts[o]; n > 0 {
			parts = append(parts, fmt.Sprintf("%s %s", o, human(n)))
		}
	}
	fmt.Fprintf(out, "%s dead letter(s): %s\n", human(total), strings.Join(parts, ", "))
	if err != nil {
		return fmt.Errorf("stopped after %s dead letter(s): %w", human(total), err)
	}
	if left > 0 {
		return withCode(ExitLeft, fmt.Errorf("%s dead letter(s) left as they are (failed %s: their key failed for good, past its policy's max_attempts; payload lost %s: only the sender can deliver them again)",
			human(left), human(counts[inbox.ReplayFailed]), human(counts[inbox.ReplayPayloadLost])))
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
