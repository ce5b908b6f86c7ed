// Command idemctl operates idem: migrations, prune, partition rotation, a
// cron daemon, stats and health checks. See docs/idemctl.md.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/idemkit/idem/cmd/idemctl/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], os.Stdout, os.Stderr, os.Getenv)
	stop()
	os.Exit(code)
}
