package cli

import (
	"errors"
	"strings"

	"fmt"
	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/db/pgxdb"
)

func init() { register(newReleaseCmd) }

func newReleaseCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "release", Short: "re-run one event: forget --source S --key K, so its next delivery runs the work again (caches included)", Args: cobra.ArbitraryArgs,
		Example: `  idemctl release --source stripe --key evt_1NQ2`}
	fs := cmd.Flags()
	source := fs.String("source", "", "the key's source (required)")
	key := fs.String("key", "", "the key (required)")
	a.completeSources(cmd, "source")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if len(args) > 0 || *source == "" || *key == "" {
			return usageErr("release needs --source S and --key K, and nothing else")
		}
		if _, err := g.logger(io.Err); err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 1)
		if err != nil {
			return err
		}
		defer pool.Close()
		n, err := pgxdb.New(pool).Release(ctx, pgxdb.ReleaseParams{Source: *source, Key: *key})
		if err != nil {
			return releaseErr(*source, *key, err)
		}
		if n == 0 {
			fmt.Fprintf(io.Out, "nothing to release: %s/%s is not stored (its next delivery runs the work anyway)\n", *source, idem.Quote(*key))
			return nil
		}
		// Every process's cache (idem.Config.Cache) has dropped the key, or
		// stopped answering, by the end of the grace.
		select {
		case <-time.After(idem.ReleaseGrace):
		case <-ctx.Done():
			return ctx.Err()
		}
		fmt.Fprintf(io.Out, "released %s/%s (%d row(s)): its next delivery runs the work again\n", *source, idem.Quote(*key), n)
		return nil
	}
	return cmd
}

// releaseErr explains a refused release. A key the inbox holds (a queued
// job, or a dead letter) is not released: the operator's way for it is
// idemctl inbox replay, named with the key's own flags.
func releaseErr(source, key string, err error) error {
	var pg *pgconn.PgError
	if errors.As(err, &pg) && pg.Code == sqlstate.KeyBusy && strings.Contains(pg.Message, "held by the inbox") {
		return fmt.Errorf("%s/%s is held by the inbox (a queued job or a dead letter), so release leaves it alone: "+
			"if it is a dead letter, use `idemctl inbox replay --source %s --key %s` (`idemctl inbox list --source %s --key %s` shows it); a queued job processes it by itself",
			source, idem.Quote(key), shellQuote(source), shellQuote(key), shellQuote(source), shellQuote(key))
	}
	if errors.As(err, &pg) && pg.Hint != "" {
		return fmt.Errorf("release %s/%s: %w (%s)", source, idem.Quote(key), err, pg.Hint)
	}
	return fmt.Errorf("release %s/%s: %w", source, idem.Quote(key), err)
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	if s != "" && !strings.ContainsFunc(s, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./:@=+,", r))
	}) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
