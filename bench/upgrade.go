package main

import (
	"bytes"
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/exec"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/upgradeload"
	"github.com/idemkit/idem/migrate"
)

// Flags of the upgrade section.
var (
	upgradeFrom    int64 = 18
	upgradeKeys    int   // 0: 200,000 (full: 2,000,000)
	upgradeClients = 4
	upgradeIdemctl string // run this idemctl binary's migrate up instead of migrate.New in-process
)

// benchUpgrade: a database at version upgradeFrom holding upgradeKeys
// stored keys is migrated to the latest version while upgradeClients
// clients claim (new keys and duplicates of stored ones): the longest
// claim, and the longest a claim waited on a lock the migration held or
// was queued for (pg_locks). The migration is idemctl migrate up's: the
// binary given with -idemctl (with --river=false), or the same code in
// process (migrate.New with idemctl's default lock timeout and retries).
func benchUpgrade(ctx context.Context, e *env, o options, t *table) error {
	keys := upgradeKeys
	if keys == 0 {
		keys = 200_000
		if o.full {
			keys = 2_000_000
		}
	}
	// A durable cluster of its own (fsync on, as in production), or the
	// server given with -database-url.
	adminURL, server := e.url, "the given server"
	if e.cluster != nil {
		c, err := pgcluster.Start(ctx, pgcluster.Durable())
		if err != nil {
			return fmt.Errorf("start a durable cluster: %w", err)
		}
		defer c.Stop()
		adminURL, server = c.URL("postgres"), "durable (fsync on)"
	}
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	const name = "idem_bench_upgrade"
	id := pgx.Identifier{name}.Sanitize()
	if _, err := admin.Exec(ctx, `DROP DATABASE IF EXISTS `+id+` WITH (FORCE)`); err != nil {
		return err
	}
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+id); err != nil {
		return fmt.Errorf("create database %s (the role needs CREATEDB): %w", name, err)
	}
	defer admin.Exec(context.Background(), `DROP DATABASE IF EXISTS `+id+` WITH (FORCE)`) //nolint:errcheck
	u, err := databaseURL(adminURL, name)
	if err != nil {
		return err
	}
	cfg, err := pgx.ParseConfig(upgradeload.MigratorURL(u))
	if err != nil {
		return err
	}
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	if err := upTo(ctx, db, upgradeFrom); err != nil {
		return fmt.Errorf("migrate to %d: %w", upgradeFrom, err)
	}
	pcfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return err
	}
	pcfg.MaxConns = int32(upgradeClients + 2)
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	start := time.Now()
	if err := upgradeload.Seed(ctx, pool, keys); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE idem.processed_events`); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "bench: upgrade: %s keys stored at version %d in %s\n", fmtCount(keys), upgradeFrom, time.Since(start).Round(time.Second))

	load, err := upgradeload.Start(ctx, pool, upgradeClients)
	if err != nil {
		return err
	}
	start = time.Now()
	how, out, migErr := runUpgrade(ctx, db, upgradeload.MigratorURL(u))
	took := time.Since(start)
	seen, monErr := load.Stop()
	if migErr != nil {
		return fmt.Errorf("%s: %w\n%s", how, migErr, out)
	}
	if monErr != nil {
		return fmt.Errorf("the lock monitor: %w", monErr)
	}
	fmt.Fprintf(os.Stderr, "bench: upgrade: %s took %s\n%s", how, took.Round(time.Millisecond), out)
	note := ""
	if len(seen.Errs) > 0 {
		note = fmt.Sprintf("; %d claims failed, the first: %v", len(seen.Errs), seen.Errs[0])
	}
	t.add(row{section: "upgrade",
		metric: fmt.Sprintf("%s from version %d to %d, %s stored keys, %d clients claiming, %s: the longest claim (the longest wait on the migration's locks, in pg_locks)",
			how, upgradeFrom, migrate.Latest(), fmtCount(keys), upgradeClients, server),
		idem:     fmt.Sprintf("%s (%s)", seen.Longest.Round(time.Millisecond), seen.LongestWait.Round(time.Millisecond)),
		baseline: fmt.Sprintf("migration took %s; %d claims", took.Round(100*time.Millisecond), seen.Claims),
		ratio:    seen.Longest.Seconds() / 1.5, target: "< 1.5 s",
		note: fmt.Sprintf("of the 1.5 s budget; the migration's statement at the longest wait: %s%s", seen.WaitedOn, note)})
	return nil
}

// runUpgrade migrates db (whose connections carry upgradeload.MigratorApp)
// to the latest version, as idemctl migrate up does.
func runUpgrade(ctx context.Context, db *sql.DB, url string) (how, out string, err error) {
	if upgradeIdemctl != "" {
		cmd := exec.CommandContext(ctx, upgradeIdemctl, "--database-url", url, "migrate", "up", "--river=false")
		var b bytes.Buffer
		cmd.Stdout, cmd.Stderr = &b, &b
		err := cmd.Run()
		return "idemctl migrate up", b.String(), err
	}
	m, err := migrate.New(db, migrate.Config{})
	if err != nil {
		return "", "", err
	}
	_, err = m.Up(ctx)
	return "migrate.New(db, migrate.Config{}).Up (idemctl migrate up's code)", "", err
}
