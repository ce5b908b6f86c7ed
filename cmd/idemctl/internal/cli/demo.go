package cli

import (
	"context"
	"errors"
	"fmt"
	"github.com/spf13/cobra"
	"log/slog"
	"net/url"
	"os"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/cmd/idemctl/internal/demo"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/migrate"
)

func init() { register(newDemoCmd) }

const demoSchema = "idem_demo"

func newDemoCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "demo", Short: "the quick start: a webhook storm against a throwaway (or given) Postgres, with checks", Args: cobra.ArbitraryArgs,
		Example: `  idemctl demo
  idemctl demo --events 1000 --deliveries 8 --database-url postgres://localhost/postgres`}
	fs := cmd.Flags()
	var cfg demo.Config
	fs.IntVar(&cfg.Events, "events", 300, "distinct webhook events")
	fs.IntVar(&cfg.Deliveries, "deliveries", 4, "concurrent deliveries of each event")
	fs.IntVar(&cfg.Workers, "workers", 16, "concurrent handlers")
	keep := fs.Bool("keep", false, "keep the receiver's tables (schema idem_demo) afterwards")
	timeouts := fs.Bool("timeouts", true, "also run the timeout storm: a 5s handler behind a sender that gives up after 2s, answered synchronously and then asynchronously (the inbox)")
	cmd.RunE = func(_ *cobra.Command, args []string) (err error) {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if cfg.Events < 1 || cfg.Deliveries < 1 || cfg.Workers < 1 {
			return usageErr("--events, --deliveries and --workers must be at least 1")
		}
		log, err := g.logger(io.Err)
		if err != nil {
			return err
		}
		throwaway := g.resolveURL(io.Env) == ""
		if throwaway {
			fmt.Fprintln(io.Out, "no --database-url or DATABASE_URL: starting a throwaway PostgreSQL...")
			c, err := pgcluster.Start(ctx)
			if err != nil {
				if errors.Is(err, pgcluster.ErrNotInstalled) {
					return withCode(ExitUnreachable, fmt.Errorf("cannot start a throwaway PostgreSQL: %w; %s, or pass --database-url", err, pgcluster.InstallHint))
				}
				return withCode(ExitUnreachable, fmt.Errorf("cannot start a throwaway PostgreSQL: %w (or pass --database-url)", err))
			}
			defer func() {
				c.Stop()
				fmt.Fprintln(io.Out, "throwaway PostgreSQL stopped and removed")
			}()
			g.databaseURL = c.URL("postgres")
			fmt.Fprintf(io.Out, "PostgreSQL is up (port %d, data in %s)\n", c.Port, c.Dir)
		} else {
			// A given database is left exactly as it was: the demo runs in a
			// scratch database of its own on the same server, dropped at the
			// end (its keys, River's jobs, the lookbacks and counts it raises
			// go with it).
			scratch, drop, err := g.scratchDatabase(ctx, io)
			if err != nil {
				return err
			}
			defer func() {
				// A scratch database left behind is a failure of the demo.
				if derr := drop(); derr != nil && err == nil {
					err = derr
				}
			}()
			g.databaseURL = scratch
		}
		// The receiver's tables go in schema idem_demo, first on the demo's
		// search_path, so an existing database's own tables are never touched.
		pool, err := g.connect(ctx, io.Env, int32(cfg.Workers)+4, func(c *pgxpool.Config) {
			c.ConnConfig.RuntimeParams["search_path"] = demoSchema + ",public"
		})
		if err != nil {
			return err
		}
		defer pool.Close()
		db := sqlDB(pool)
		defer db.Close()
		if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{demoSchema}.Sanitize()); err != nil {
			return fmt.Errorf("create schema %s: %w", demoSchema, err)
		}
		res, err := migrate.Up(ctx, db)
		if err != nil {
			return fmt.Errorf("migrate up: %w", err)
		}
		fmt.Fprintf(io.Out, "migrations applied: %d new\n", len(res))

		{
			// The database is the demo's own (a throwaway server's, or a
			// scratch one): pin a session's idem.clock() to just before
			// midnight at the end of last month.
			cfg.ExactCounts = true
			cfg.CrossMonth = func(ctx context.Context, at time.Time) (*pgxpool.Pool, error) {
				if _, err := pool.Exec(ctx, pgcluster.ClockOverrideSQL); err != nil {
					return nil, err
				}
				if _, err := pool.Exec(ctx, `SELECT idem.create_partition($1)`, at); err != nil {
					return nil, err
				}
				pc := pool.Config().Copy()
				pc.ConnConfig.RuntimeParams[pgcluster.ClockParam] = at.Format(time.RFC3339)
				return pgxpool.NewWithConfig(ctx, pc)
			}
		}
		// The receiver's own warnings (the storm's injected failures) would
		// drown the report; only errors go to stderr.
		quiet := slog.New(slog.NewTextHandler(io.Err, &slog.HandlerOptions{Level: slog.LevelError}))
		rep, err := demo.Run(ctx, pool, cfg, quiet)
		if rep != nil {
			rep.Print(io.Out)
		}
		tok := true
		if err == nil && *timeouts {
			tok, err = demoTimeouts(ctx, io, pool, quiet)
		}
		if !*keep {
			// Dropped at the end, after the stats below have read River's jobs
			// (River's tables are in this schema too).
			defer func() {
				if _, derr := pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+pgx.Identifier{demoSchema}.Sanitize()+" CASCADE"); derr != nil {
					log.LogAttrs(ctx, slog.LevelWarn, "could not drop the demo schema", slog.Any("error", derr))
				}
			}()
		}
		if err != nil {
			return err
		}

		// The operator's side: rotation, prune and the stats an operator reads.
		fmt.Fprintln(io.Out, "\nmaintenance:")
		rot, err := partition.Rotate(ctx, pool, partition.Config{})
		if err != nil {
			return fmt.Errorf("rotate: %w", err)
		}
		fmt.Fprintf(io.Out, "  partitions rotate: %d step(s), partitions premade for the next 3 months\n", len(rot.Steps))
		pr, err := prune.Run(ctx, pool, prune.Config{})
		if err != nil {
			return fmt.Errorf("prune: %w", err)
		}
		fmt.Fprintf(io.Out, "  prune: %d expired rows deleted (the demo's keys are kept %d days)\n\n", pr.Deleted, int(demo.KeyTTL.Hours()/24))
		if err := a.execute("stats", "--database-url", pool.Config().ConnString(), "--river-schema", demoSchema); err != nil {
			return fmt.Errorf("stats: %w", err)
		}
		if !rep.OK() || !tok {
			return errors.New("some checks failed")
		}
		fmt.Fprintln(io.Out, "\nall checks passed")
		return nil
	}
	return cmd
}

// demoTimeouts runs the timeout storm in both modes and prints what the
// sender saw.
func demoTimeouts(ctx context.Context, io IO, pool *pgxpool.Pool, log *slog.Logger) (bool, error) {
	cfg := pool.Config().Copy()
	cfg.MaxConns = 64 // the storm's accepts and the inbox's workers, at once
	big, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return false, err
	}
	defer big.Close()
	fmt.Fprintln(io.Out, "\ntimeouts: 20 events, each delivered twice at once to a handler that takes 5s; the sender gives up after 2s and retries")
	var reps []*demo.TimeoutsReport
	for _, async := range []bool{false, true} {
		rep, err := demo.Timeouts(ctx, big, demo.TimeoutsConfig{Async: async}, log)
		if err != nil {
			return false, fmt.Errorf("timeout storm: %w", err)
		}
		reps = append(reps, rep)
	}
	tw := tabwriter.NewWriter(io.Out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  MODE\tREQUESTS\tTIMEOUTS\tRETRIES\tNON-2XX\tP50\tP99\tMAX\tPROCESSED ONCE\tTWICE+\tALL DONE AFTER")
	for _, r := range reps {
		fmt.Fprintf(tw, "  %s\t%d\t%d\t%d\t%d\t%s\t%s\t%s\t%d of %d\t%d\t%s\n", r.Mode, r.Requests, r.Timeouts, r.Retries, r.Non2xx,
			r.P50.Round(100*time.Microsecond), r.P99.Round(100*time.Microsecond), r.Max.Round(100*time.Microsecond),
			r.ProcessedOnce, r.Events, r.Repeat, r.Elapsed.Round(10*time.Millisecond))
	}
	tw.Flush()
	sync, async := reps[0], reps[1]
	mark := map[bool]string{true: "PASS", false: "FAIL"}
	fmt.Fprintf(io.Out, "  [%s] asynchronous: every delivery answered at once (p99 %s), no timeouts, each event processed once\n",
		mark[async.AsyncOK()], async.P99.Round(100*time.Microsecond))
	fmt.Fprintf(io.Out, "  [%s] synchronous: %d timeouts and %d retries, and still each event processed once (idem)\n",
		mark[sync.OnceEach()], sync.Timeouts, sync.Retries)
	if async.Inbox != nil {
		fmt.Fprintf(io.Out, "  [%s] reconciliation: %s\n", mark[async.ReconcileOK()], async.Inbox)
	}
	ok := async.AsyncOK() && sync.OnceEach() && async.ReconcileOK()
	return ok, nil
}

// scratchDatabase creates a database of the demo's own on the server of
// the given connection string and returns a connection string for it and
// a function that drops it. Without the right to create one it refuses,
// saying why: the demo never writes into the given database.
func (g *globals) scratchDatabase(ctx context.Context, io IO) (string, func() error, error) {
	admin, err := g.connect(ctx, io.Env, 1)
	if err != nil {
		return "", nil, err
	}
	defer admin.Close()
	// The drop connects to the given database: by then the connection
	// string names the scratch one, which cannot drop itself.
	given := admin.Config().ConnConfig.Database
	name := fmt.Sprintf("idem_demo_%d_%d", os.Getpid(), time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", nil, withCode(ExitUsage, fmt.Errorf("the demo runs in a scratch database of its own, so that it leaves the given one as it was, and could not create one: %w; give a role with CREATEDB, or run idemctl demo without --database-url for a throwaway server", err))
	}
	fmt.Fprintf(io.Out, "running in scratch database %s on the given server (dropped afterwards; the given database is not touched)\n", name)
	drop := func() error {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		a, err := g.connect(dctx, io.Env, 1, func(c *pgxpool.Config) { c.ConnConfig.Database = given })
		if err == nil {
			_, err = a.Exec(dctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
			a.Close()
		}
		if err != nil {
			return fmt.Errorf("could not drop scratch database %s (drop it by hand): %s", name, redact(err.Error()))
		}
		return nil
	}
	return inDatabase(g.resolveURL(io.Env), name), drop, nil
}

// inDatabase is connection string conn pointed at database name.
func inDatabase(conn, name string) string {
	if u, err := url.Parse(conn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Path = "/" + name
		q := u.Query()
		q.Del("dbname")
		u.RawQuery = q.Encode()
		return u.String()
	}
	return conn + " dbname=" + name // a later keyword wins in a key=value string
}
