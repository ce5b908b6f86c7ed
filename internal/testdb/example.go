package testdb

import (
	"context"
	"log"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ExamplePool opens a pool on a fresh database for an Example function (in
// an application: pgxpool.New(ctx, os.Getenv("DATABASE_URL"))); done
// closes the pool and drops the database. It exits the program when no
// database can be had, as an Example cannot fail otherwise.
func ExamplePool() (pool *pgxpool.Pool, done func()) {
	url, drop, err := Create()
	if err != nil {
		log.Fatal(err)
	}
	pool, err = pgxpool.New(context.Background(), url)
	if err != nil {
		log.Fatal(err)
	}
	return pool, func() { pool.Close(); _ = drop() }
}
