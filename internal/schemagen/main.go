// Command schemagen writes sql/schema/ (schema idem as the migrations leave
// it, one file per object) or, with -check, fails when the committed files
// differ from what the migrations produce. It migrates a database of a
// throwaway PostgreSQL cluster it starts itself (package pgcluster: the
// local server binaries), or of the server IDEM_SCHEMA_DATABASE_URL names
// (a role that may CREATE DATABASE; the database is created and dropped).
//
//	go run ./internal/schemagen          # make schema
//	go run ./internal/schemagen -check   # make schema-check
package main

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/internal/pgcluster"
	"github.com/idemkit/idem/internal/schemadump"
	"github.com/idemkit/idem/migrate"
)

// envURL names a server to use instead of a throwaway cluster.
const envURL = "IDEM_SCHEMA_DATABASE_URL"

func main() {
	dir := flag.String("dir", "sql/schema", "the directory of the committed files")
	check := flag.Bool("check", false, "compare instead of writing: exit 1 when the files differ")
	flag.Parse()
	if err := run(*dir, *check); err != nil {
		fmt.Fprintln(os.Stderr, "schemagen:", err)
		os.Exit(1)
	}
}

func run(dir string, check bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	files, err := dumpMigrated(ctx)
	if err != nil {
		return err
	}
	if check {
		if err := schemadump.Check(dir, files); err != nil {
			return err
		}
		fmt.Printf("%s matches the migrations (%d files, migration %d)\n", dir, len(files), migrate.Latest())
		return nil
	}
	if err := schemadump.Write(dir, files); err != nil {
		return err
	}
	fmt.Printf("wrote %d files to %s (migration %d)\n", len(files), dir, migrate.Latest())
	return nil
}

// dumpMigrated migrates a new database to the latest version and dumps it.
func dumpMigrated(ctx context.Context) (map[string]string, error) {
	admin := os.Getenv(envURL)
	if admin == "" {
		c, err := pgcluster.Start(ctx)
		if err != nil {
			return nil, fmt.Errorf("start a throwaway PostgreSQL: %w (%s, or set %s)", err, pgcluster.InstallHint, envURL)
		}
		defer c.Remove()
		defer c.Stop()
		admin = c.URL("postgres")
	}
	name := fmt.Sprintf("idem_schema_%d", rand.IntN(1e9))
	aconn, err := pgx.Connect(ctx, admin)
	if err != nil {
		return nil, err
	}
	defer aconn.Close(context.WithoutCancel(ctx))
	if _, err := aconn.Exec(ctx, "CREATE DATABASE "+name+" TEMPLATE template0"); err != nil {
		return nil, err
	}
	defer aconn.Exec(context.WithoutCancel(ctx), "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)")
	cfg, err := pgx.ParseConfig(admin)
	if err != nil {
		return nil, err
	}
	cfg.Database = name
	db := stdlib.OpenDB(*cfg)
	defer db.Close()
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return schemadump.Migrated(ctx, db, conn)
}
