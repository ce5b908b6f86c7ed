package main

import (
	"context"
	"database/sql"
	"log"
	"os"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver

	"github.com/idemkit/idem/migrate"
)

func main() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := migrate.Up(ctx, db); err != nil { // files in migrate.FS()
		log.Fatal(err)
	}
	// Or goose's Provider over the same guarded steps, without the retries:
	p, err := migrate.NewProvider(db)
	if err != nil {
		log.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		log.Fatal(err)
	}
}
