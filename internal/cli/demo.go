package cli

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/demo"
	"github.com/idemkit/idem/internal/partition"
	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/migrate"
)

func init() {
	register(command{name: "demo", summary: "the quick start: a webhook storm against a throwaway (or given) Postgres, with checks", run: runDemo})
}

const demoSchema = "idem_demo"

func runDemo(ctx context.Context, io IO, g *globals, args []string) error {
	fs := newFlagSet("demo", io, g)
	var cfg demo.Config
	fs.IntVar(&cfg.Events, "events", 300, "distinct webhook events")
	fs.IntVar(&cfg.Deliveries, "deliveries", 4, "concurrent deliveries of each event")
	fs.IntVar(&cfg.Workers, "workers", 16, "concurrent handlers")
	keep := fs.Bool("keep", false, "keep the receiver's tables (schema idem_demo) afterwards")
	if err := fs.parse(args); err != nil {
		return err
	}
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
			return withCode(ExitUnreachable, fmt.Errorf("cannot start a throwaway PostgreSQL: %w; %s, or pass --database-url", err, pgcluster.InstallHint))
		}
		defer func() {
			c.Stop()
			fmt.Fprintln(io.Out, "throwaway PostgreSQL stopped and removed")
		}()
		g.databaseURL = c.URL("postgres")
		fmt.Fprintf(io.Out, "PostgreSQL is up (port %d, data in %s)\n", c.Port, c.Dir)
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

	if throwaway {
		// Only in the throwaway database: pin a session's idem.clock() to
		// just before midnight at the end of last month.
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
	if !*keep {
		if _, derr := pool.Exec(context.WithoutCancel(ctx), "DROP SCHEMA IF EXISTS "+pgx.Identifier{demoSchema}.Sanitize()+" CASCADE"); derr != nil {
			log.LogAttrs(ctx, slog.LevelWarn, "could not drop the demo schema", slog.Any("error", derr))
		}
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
	if err := runStats(ctx, io, &globals{}, []string{"--database-url", pool.Config().ConnString()}); err != nil {
		return fmt.Errorf("stats: %w", err)
	}
	if !rep.OK() {
		return errors.New("some checks failed")
	}
	fmt.Fprintln(io.Out, "\nall checks passed")
	return nil
}
