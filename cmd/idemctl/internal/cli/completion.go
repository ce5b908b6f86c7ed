package cli

import (
	"context"
	"time"

	"github.com/spf13/cobra"
)

// completeSources completes the flag name of cmd (and its subcommands)
// with the sources the database knows (policies, snapshots, the last
// minutes' activity), when a database URL is given (--database-url on
// the line being completed, or DATABASE_URL). Without one, or when the
// database does not answer within 3 seconds, nothing is proposed.
func (a *app) completeSources(cmd *cobra.Command, name string) {
	// Registered after the flag is defined: an error here is a bug.
	if err := cmd.RegisterFlagCompletionFunc(name, func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return a.sources(), cobra.ShellCompDirectiveNoFileComp
	}); err != nil {
		panic(err)
	}
}

func (a *app) sources() []string {
	if a.g.resolveURL(a.io.Env) == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(a.ctx, 3*time.Second)
	defer cancel()
	g := a.g
	pool, err := g.connect(ctx, a.io.Env, 1)
	if err != nil {
		return nil
	}
	defer pool.Close()
	rows, err := pool.Query(ctx, `SELECT source FROM idem.policies WHERE source <> '*'
	                              UNION SELECT source FROM idem.source_snapshots
	                              UNION SELECT source FROM idem.activity
	                              ORDER BY 1 LIMIT 1000`)
	if err != nil {
		return nil
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var s string
		if rows.Scan(&s) == nil {
			out = append(out, s)
		}
	}
	return out
}
