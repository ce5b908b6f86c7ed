package cli

import (
	"context"
	"fmt"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/db/pgxdb"
)

func init() {
	register(command{name: "release", summary: "re-run one event: forget --source S --key K, so its next delivery runs the work again (caches included)", run: runRelease})
}

func runRelease(ctx context.Context, io IO, g *globals, args []string) error {
	fs := newFlagSet("release", io, g)
	source := fs.String("source", "", "the key's source (required)")
	key := fs.String("key", "", "the key (required)")
	if err := fs.parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 || *source == "" || *key == "" {
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
		return fmt.Errorf("release %s/%s: %w", *source, idem.Quote(*key), err)
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
