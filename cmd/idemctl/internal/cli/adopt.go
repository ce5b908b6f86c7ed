package cli

import (
	"fmt"
	"github.com/spf13/cobra"
	"log/slog"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"
)

func init() { register(newAdoptCmd) }

// adoptProgress is how often adopt logs its progress.
const adoptProgress = 5 * time.Second

func newAdoptCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "adopt", Short: "copy an existing processed-events table into idem, online, in resumable batches", Args: cobra.ArbitraryArgs,
		Example: `  idemctl adopt --table legacy.processed --source stripe --key-column event_id --at-column processed_at
  idemctl adopt --table legacy.processed --source stripe --key-column event_id --at-column day --ttl 720h --batch-size 10000`}
	fs := cmd.Flags()
	table := fs.String("table", "", "the legacy table, schema-qualified or on the search_path (required)")
	source := fs.String("source", "", "the idem source its events belong to (required)")
	keyCol := fs.String("key-column", "", "the column holding the event id (required)")
	atCol := fs.String("at-column", "", "the column holding when the event was processed: timestamptz, timestamp (taken as UTC) or date (required)")
	resultCol := fs.String("result-column", "", "a column holding the result to replay to duplicates (optional; stored as jsonb)")
	ttl := fs.Duration("ttl", 0, "retention of the adopted keys, from when each was processed (default: the source's policy)")
	batch := fs.Int("batch-size", 5000, "legacy rows per batch, each its own transaction (1 to 1000000)")
	sleep := fs.Duration("sleep", 50*time.Millisecond, "pause between batches, jittered +-50% (0: none)")
	a.completeSources(cmd, "source")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		switch {
		case len(args) > 0:
			return usageErr("adopt takes no arguments, got %q", args)
		case *table == "" || *source == "" || *keyCol == "" || *atCol == "":
			return usageErr("adopt needs --table, --source, --key-column and --at-column")
		case *batch < 1 || *batch > 1_000_000:
			return usageErr("--batch-size %d must be between 1 and 1000000", *batch)
		case *ttl < 0 || (*ttl > 0 && (*ttl < time.Minute || *ttl > 10*365*24*time.Hour)):
			return usageErr("--ttl %v must be between 1m and 10 years (0: the source's policy)", *ttl)
		case *sleep < 0:
			return usageErr("--sleep %v must not be negative", *sleep)
		}
		log, err := g.logger(io.Err)
		if err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 1)
		if err != nil {
			return err
		}
		defer pool.Close()
		var result, ttlArg any
		if *resultCol != "" {
			result = *resultCol
		}
		if *ttl > 0 {
			ttlArg = fmt.Sprintf("%d milliseconds", ttl.Milliseconds())
		}
		var id int64
		if err := pool.QueryRow(ctx, `SELECT idem.adopt_start($1, $2::regclass, $3, $4, $5, $6::interval)`,
			*source, *table, *keyCol, *atCol, result, ttlArg).Scan(&id); err != nil {
			return fmt.Errorf("adopt %s: %w", *table, err)
		}
		var copied0 int64
		_ = pool.QueryRow(ctx, `SELECT copied FROM idem.adoptions WHERE id = $1`, id).Scan(&copied0)
		if copied0 > 0 {
			log.LogAttrs(ctx, slog.LevelInfo, "adopt: resuming", slog.Int64("adoption", id), slog.Int64("copied_before", copied0))
		}
		start, last := time.Now(), time.Now()
		var read, copied, skipped int64
		for {
			var r, c, s int64
			var done bool
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				return tx.QueryRow(ctx, `SELECT read, copied, skipped, done FROM idem.adopt_batch($1, $2)`, id, *batch).Scan(&r, &c, &s, &done)
			})
			if err != nil {
				return fmt.Errorf("adopt %s, after %d rows: %w (run the same command again to resume)", *table, read, err)
			}
			read, copied, skipped = read+r, copied+c, skipped+s
			if time.Since(last) >= adoptProgress {
				last = time.Now()
				log.LogAttrs(ctx, slog.LevelInfo, "adopt: progress", slog.Int64("read", read), slog.Int64("copied", copied),
					slog.Int64("skipped", skipped), slog.Float64("rows_per_second", float64(read)/time.Since(start).Seconds()))
			}
			if done {
				break
			}
			if *sleep > 0 {
				pause := *sleep/2 + rand.N(*sleep+1)
				select {
				case <-time.After(pause):
				case <-ctx.Done():
					return fmt.Errorf("adopt %s interrupted after %d rows (run the same command again to resume): %w", *table, read, ctx.Err())
				}
			}
		}
		took := time.Since(start)
		// What the whole adoption (every run of it) skipped, and why.
		var future, bad, noStamp, skippedAll int64
		if err := pool.QueryRow(ctx, `SELECT future, bad_keys, no_stamp, skipped FROM idem.adoptions WHERE id = $1`, id).Scan(&future, &bad, &noStamp, &skippedAll); err != nil {
			return fmt.Errorf("adopt %s: the adoption's report: %w", *table, err)
		}
		fmt.Fprintf(io.Out, "adopted %s into source %s: %s rows read, %s copied, %s skipped in %s (%s rows/s); claims no longer consult it\n",
			*table, *source, human(read), human(copied), human(skipped), took.Round(time.Millisecond), humanRate(float64(read)/took.Seconds()))
		fmt.Fprintf(io.Out, "skipped over the whole adoption: %s with a NULL, empty, blank or over-512-byte key, %s with no processed-at, %s past their retention or already in idem\n",
			human(bad), human(noStamp), human(skippedAll-bad-noStamp))
		if future > 0 {
			fmt.Fprintf(io.Out, "%s rows stamped in the future were adopted as processed now (their retention counts from now)\n", human(future))
		}
		return nil
	}
	return cmd
}
