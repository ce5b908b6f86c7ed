package cli

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"github.com/spf13/cobra"
	"log/slog"
	"math"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/migrate"
)

func init() { register(newMigrateCmd) }

func newMigrateCmd(a *app) *cobra.Command {
	var to *int64
	cmd := &cobra.Command{
		Use:   "migrate up|down|status|version",
		Short: "apply idem's migrations (and River's, for the inbox): up | down [--to N] | status | version",
		Long: `Applies idem's embedded migrations with idem's own version table
(idem.goose_db_version) and lock, then River's (the inbox's queue).
A down that would drop stored state is refused unless --force.`,
		Example: `  idemctl migrate up
  idemctl migrate status
  idemctl migrate down --to 14 --force`,
		Args: cobra.ArbitraryArgs,
		RunE: needSubcommand,
	}
	fs := cmd.PersistentFlags()
	optInt64(fs, &to, "to", "up: the latest; down: the previous version", "up: apply migrations up to this version; down: roll back to this version (0 removes everything but the schema)")
	force := fs.Bool("force", false, "down: drop the stored state the down would drop (keys, inbox holds, an adoption, policies' settings, run history); without it such a down is refused, saying what it would drop")
	retries := fs.Int("lock-retries", migrate.DefaultRetries, "up, down: how many times a step that timed out waiting for a table lock (--lock-timeout) is retried before giving up (0: none)")
	withRiver := fs.Bool("river", true, "up: also apply River's migrations (the inbox's queue; only the versions missing, safe next to an application's own River)")
	riverSchema := fs.String("river-schema", "", "up: the schema of River's tables (default: the search_path, as River's own client)")
	citus := fs.Bool("citus", false, "up: distribute idem on this Citus coordinator (docs/citus.md); once distributed, every up does it again")
	for _, s := range []struct{ name, short, example string }{
		{"up", "apply every migration not applied yet (or up to --to), then River's", "  idemctl migrate up\n  idemctl migrate up --to 15 --river=false"},
		{"down", "roll back one migration (or to --to); refused when it would drop stored state, unless --force", "  idemctl migrate down\n  idemctl migrate down --to 14 --force"},
		{"status", "every migration, applied (when) or pending", "  idemctl migrate status"},
		{"version", "the database's schema version", "  idemctl migrate version"},
	} {
		sub := s.name
		cmd.AddCommand(&cobra.Command{Use: sub, Short: s.short, Example: s.example, Args: noArgs("migrate " + sub),
			RunE: func(*cobra.Command, []string) error {
				return a.runMigrate(sub, to, *force, *retries, *withRiver, *riverSchema, *citus)
			}})
	}
	return cmd
}

func (a *app) runMigrate(sub string, to *int64, force bool, retries int, withRiver bool, riverSchema string, citus bool) error {
	ctx, io, g := a.ctx, a.io, &a.g
	if to != nil && *to < 0 {
		return usageErr("--to %d is not a version: give 0 or more (0: before the first migration)", *to)
	}
	if citus && sub != "up" {
		return usageErr("--citus is for migrate up, not %s", sub)
	}
	if retries < 0 {
		return usageErr("--lock-retries %d: give 0 or more", retries)
	}
	if g.lockTimeout < time.Millisecond {
		return usageErr("--lock-timeout %v: give at least 1ms", g.lockTimeout)
	}
	if to != nil && sub != "up" && sub != "down" {
		return usageErr("--to is for migrate up and down, not %s", sub)
	}
	log, err := g.logger(io.Err)
	if err != nil {
		return err
	}
	pool, err := g.connect(ctx, io.Env, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := sqlDB(pool)
	defer db.Close()
	if retries == 0 {
		retries = -1 // migrate.Config: -1 is none
	}
	m, err := migrate.New(db, migrate.Config{LockTimeout: g.lockTimeout, Retries: retries, Logger: log.With(slog.String("component", "goose"))})
	if err != nil {
		return err
	}
	p := m.Provider()
	switch sub {
	case "up":
		return migrateUp(ctx, io, m, db, pool, to, citus, withRiver, riverSchema)
	case "down":
		return migrateDown(ctx, io, m, to, force)
	case "status":
		st, err := p.Status(ctx)
		if err != nil {
			return err
		}
		for _, s := range st {
			when := "pending"
			if s.State == goose.StateApplied {
				when = "applied " + s.AppliedAt.UTC().Format("2006-01-02 15:04:05Z")
			}
			fmt.Fprintf(io.Out, "%-40s %s\n", s.Source.Path, when)
		}
	case "version":
		v, err := p.GetDBVersion(ctx)
		if err != nil {
			return err
		}
		fmt.Fprintln(io.Out, v)
	}
	return nil
}

// migrateUp applies idem's migrations up to to (nil: all), then Citus'
// step where asked or distributed already, then River's (only when going
// to the latest).
func migrateUp(ctx context.Context, io IO, m *migrate.Migrator, db *sql.DB, pool *pgxpool.Pool, to *int64, citus, withRiver bool, riverSchema string) error {
	upTo := int64(math.MaxInt64)
	if to != nil {
		upTo = *to
	}
	res, err := m.UpTo(ctx, upTo)
	for _, r := range res {
		fmt.Fprintf(io.Out, "applied %s (%s)\n", r.Source.Path, r.Duration.Round(time.Millisecond))
	}
	if err != nil {
		return err
	}
	if len(res) == 0 {
		fmt.Fprintln(io.Out, "idem schema is up to date")
	}
	if err := upCitus(ctx, io, db, citus); err != nil {
		return err
	}
	if !withRiver || to != nil {
		return nil
	}
	versions, err := inbox.Migrate(ctx, pool, riverSchema)
	if err != nil {
		return err
	}
	if len(versions) == 0 {
		fmt.Fprintln(io.Out, "River schema is up to date")
	} else {
		fmt.Fprintf(io.Out, "applied River migrations %v\n", versions)
	}
	return nil
}

// migrateDown rolls back to to (nil: the previous version); a down that
// would drop stored state is refused (exit 1) unless force is set.
func migrateDown(ctx context.Context, io IO, m *migrate.Migrator, to *int64, force bool) error {
	current, err := m.Provider().GetDBVersion(ctx)
	if err != nil {
		return err
	}
	if current == 0 {
		fmt.Fprintln(io.Out, "nothing to roll back")
		return nil
	}
	target := current - 1
	if to != nil {
		target = *to
	}
	res, err := m.DownTo(ctx, target, force)
	for _, r := range res {
		fmt.Fprintf(io.Out, "rolled back %s\n", r.Source.Path)
	}
	if errors.Is(err, migrate.ErrWouldDropKeys) || errors.Is(err, migrate.ErrWouldLoseState) {
		return withCode(ExitError, err)
	}
	return err
}

// upCitus runs migrate.Citus after an up with --citus, and after every up
// of an installation that is distributed already (a migration that
// replaced a per-key function reset what Citus needs).
func upCitus(ctx context.Context, io IO, db *sql.DB, asked bool) error {
	if !asked {
		d, err := migrate.Distributed(ctx, db)
		if err != nil || !d {
			return err
		}
	}
	done, err := migrate.Citus(ctx, db)
	if err != nil {
		return err
	}
	for _, s := range done {
		fmt.Fprintln(io.Out, "citus:", s)
	}
	if len(done) == 0 {
		fmt.Fprintln(io.Out, "citus: idem is distributed")
	}
	return nil
}
