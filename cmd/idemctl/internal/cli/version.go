package cli

import (
	"context"
	"fmt"
	"io/fs"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/idemkit/idem/migrate"
)

func init() { register(newVersionCmd) }

func newVersionCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "idemctl's version and its modules'; with a database URL, the schema's and what `migrate up` would apply",
		Example: `  idemctl version
  idemctl --version
  idemctl version --database-url postgres://idem@db/app`,
		Args: noArgs("version"),
		RunE: func(*cobra.Command, []string) error { return a.version() },
	}
}

// version prints the binary's version (its module's, and the commit it
// was built from when the build recorded one), the versions of the
// modules built into it, the schema version it needs, and, when a
// database URL is given (--database-url or DATABASE_URL), the database's
// schema version and the migrations `migrate up` would apply.
func (a *app) version() error {
	out := a.io.Out
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		fmt.Fprintf(out, "idemctl (no build information) %s\n", runtime.Version())
	} else {
		v := bi.Main.Version
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				v += " commit " + s.Value
			case "vcs.modified":
				if s.Value == "true" {
					v += " (modified)"
				}
			}
		}
		fmt.Fprintf(out, "idemctl %s %s %s/%s\n", v, bi.GoVersion, runtime.GOOS, runtime.GOARCH)
	}
	fmt.Fprintf(out, "schema: this idemctl needs idem version %d\n", migrate.Latest())
	if ok && len(bi.Deps) > 0 {
		fmt.Fprintln(out, "modules:")
		for _, d := range bi.Deps {
			if d.Replace != nil {
				d = d.Replace
			}
			fmt.Fprintf(out, "  %s %s\n", d.Path, d.Version)
		}
	}
	if a.g.resolveURL(a.io.Env) == "" {
		return nil
	}
	pool, err := a.g.connect(a.ctx, a.io.Env, 1)
	if err != nil {
		return err
	}
	defer pool.Close()
	return databaseVersion(a.ctx, a.io, pool)
}

// databaseVersion reads idem's version table (without goose, which would
// create it) and names the embedded migrations not applied yet.
func databaseVersion(ctx context.Context, io IO, pool *pgxpool.Pool) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var applied []int64
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('idem.goose_db_version') IS NOT NULL`).Scan(&exists); err != nil {
		return fmt.Errorf("read the schema version: %w", err)
	}
	if exists {
		rows, err := pool.Query(ctx, `SELECT version_id FROM idem.goose_db_version WHERE version_id > 0 AND is_applied`)
		if err != nil {
			return fmt.Errorf("read the schema version: %w", err)
		}
		for rows.Next() {
			var v int64
			if err := rows.Scan(&v); err != nil {
				rows.Close()
				return err
			}
			applied = append(applied, v)
		}
		if err := rows.Err(); err != nil {
			return fmt.Errorf("read the schema version: %w", err)
		}
	}
	var current int64
	for _, v := range applied {
		current = max(current, v)
	}
	entries, err := fs.ReadDir(migrate.FS(), ".")
	if err != nil {
		return err
	}
	var pending []string
	for _, e := range entries {
		num, _, cut := strings.Cut(e.Name(), "_")
		n, err := strconv.ParseInt(num, 10, 64)
		if !cut || err != nil || !strings.HasSuffix(e.Name(), ".sql") || slices.Contains(applied, n) {
			continue
		}
		pending = append(pending, e.Name())
	}
	switch {
	case !exists:
		fmt.Fprintln(io.Out, "database: schema idem is not installed")
	case current > migrate.Latest():
		fmt.Fprintf(io.Out, "database: schema idem at version %d, newer than this idemctl (%d): use the idemctl of the release that migrated it\n", current, migrate.Latest())
	default:
		fmt.Fprintf(io.Out, "database: schema idem at version %d\n", current)
	}
	if len(pending) == 0 {
		fmt.Fprintln(io.Out, "migrate up would apply: nothing (up to date)")
		return nil
	}
	fmt.Fprintf(io.Out, "migrate up would apply %d migration(s): %s\n", len(pending), strings.Join(pending, ", "))
	return nil
}
