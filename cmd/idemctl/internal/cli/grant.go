package cli

import (
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/sqlstate"
)

func init() { register(newGrantCmd) }

func newGrantCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "grant", Short: "least privilege: --app ROLE (claim/complete/fail/extend only), --maintainer ROLE (prune, rotate, stats)", Args: cobra.ArbitraryArgs,
		Example: `  idemctl grant --app app_role --maintainer ops_role`}
	fs := cmd.Flags()
	app := fs.String("app", "", "role that may only run the protocol functions")
	maint := fs.String("maintainer", "", "role that may prune, rotate and read stats")
	riverSchema := fs.String("river-schema", "", "the schema of River's tables, for the inbox's rights (default: the search_path)")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if len(args) > 0 || (*app == "" && *maint == "") {
			return usageErr("grant needs --app ROLE and/or --maintainer ROLE")
		}
		if _, err := g.logger(io.Err); err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 1)
		if err != nil {
			return err
		}
		defer pool.Close()
		if *app != "" && *maint != "" {
			var same bool
			if err := pool.QueryRow(ctx, `SELECT $1::regrole::oid = $2::regrole::oid`, *app, *maint).Scan(&same); err != nil {
				return fmt.Errorf("resolve the roles: %w", err)
			}
			if same {
				return usageErr("--app and --maintainer name the same role %q: the application role would read every stored result; use two roles", *app)
			}
		}
		// The role name travels as a parameter and is resolved by ::regrole,
		// which quotes it in the GRANTs; nothing is spliced into SQL here.
		for _, x := range []struct{ fn, role string }{{"idem.grant_app", *app}, {"idem.grant_maintainer", *maint}} {
			if x.role == "" {
				continue
			}
			if _, err := pool.Exec(ctx, "SELECT "+x.fn+"($1::regrole)", x.role); err != nil {
				// A grant that would make one role both application and
				// maintainer is refused as the one-role flags are: a
				// usage error (exit 2), as docs/idemctl.md says.
				var pg *pgconn.PgError
				if errors.As(err, &pg) && pg.Code == sqlstate.RoleConflict {
					return withCode(ExitUsage, fmt.Errorf("%s(%q): %w", x.fn, x.role, err))
				}
				return fmt.Errorf("%s(%q): %w", x.fn, x.role, err)
			}
			fmt.Fprintf(io.Out, "granted %s to %s\n", map[string]string{"idem.grant_app": "the application rights", "idem.grant_maintainer": "the maintainer rights"}[x.fn], x.role)
		}
		// And the inbox's rights on River's tables, when they exist (migrate
		// up gives them to these roles when River's tables come later).
		if err := inbox.GrantRiver(ctx, pool, *riverSchema); err != nil {
			return err
		}
		return nil
	}
	return cmd
}
