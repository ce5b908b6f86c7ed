package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/idemkit/idem/inbox"
)

func init() {
	register(command{name: "inbox", summary: "the inbox's dead letters: list | replay (--source S [--key K] | --since T)", run: runInbox})
}

func runInbox(ctx context.Context, io IO, g *globals, args []string) error {
	const usage = "inbox list [--source S] [--key K] [--since T] [--limit N] [--json] | replay (--source S [--key K] | --since T) [--dry-run]\n\n" +
		"list: events whose jobs River dead-lettered (discarded after their last attempt, or cancelled for a\n" +
		"permanent error), with their last error; replay: claim each again and enqueue a new job with its\n" +
		"payload; an event processed meanwhile is not run again"
	var f inbox.Filter
	var since string
	var asJSON, dryRun bool
	var schema, queue string
	flags := func(fs *flagSet, sub string) {
		fs.StringVar(&f.Source, "source", "", "only this source (e.g. stripe)")
		fs.StringVar(&f.Key, "key", "", "only this key (with --source)")
		fs.StringVar(&since, "since", "", "only those dead-lettered since: an RFC 3339 time or a duration back from now (e.g. 24h)")
		fs.StringVar(&schema, "river-schema", "", "the schema of River's tables (default: the search_path)")
		fs.StringVar(&queue, "queue", inbox.DefaultQueue, "the inbox's River queue")
		if sub != "replay" {
			fs.IntVar(&f.Limit, "limit", 1000, "at most this many")
			fs.BoolVar(&asJSON, "json", false, "print JSON")
		} else {
			fs.BoolVar(&dryRun, "dry-run", false, "list what would be replayed, change nothing")
		}
	}
	if len(args) > 0 && isHelp(args[0]) {
		fs := newFlagSet("inbox", io, g)
		flags(fs, "")
		return subcommandHelp(io.Out, usage, fs)
	}
	scan := newFlagSet("inbox", io, g)
	flags(scan, "")
	sub, rest := subcommand(args, scan.FlagSet)
	if sub == "" {
		return usageErr("inbox needs a subcommand: list or replay")
	}
	if sub != "list" && sub != "replay" {
		return usageErr("unknown inbox subcommand %q: want list or replay", sub)
	}
	fs := newFlagSet("inbox "+sub, io, g)
	flags(fs, sub)
	if err := fs.parse(rest); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageErr("inbox %s takes no arguments, got %q", sub, fs.Args())
	}
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
			fmt.Fprintf(io.Out, "would replay %d dead letter(s):\n", len(dead))
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
