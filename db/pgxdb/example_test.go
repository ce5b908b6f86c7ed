package pgxdb_test

import (
	"context"
	"fmt"
	"log"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// The generated accessors, called directly inside the application's own
// transaction (as with any sqlc package): the claim, the application's
// write and the completion commit together, so a crash anywhere leaves
// nothing half-done and the duplicate finds the stored result. A failure
// recorded with Fail releases the key for the next delivery.
func Example() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool() // in an application: pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE payments (invoice text PRIMARY KEY, cents int NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	handle := func(eventID, invoice string, cents int, fail bool) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			q := pgxdb.New(tx)
			cl, err := q.Claim(ctx, pgxdb.ClaimParams{Source: "stripe", Key: eventID})
			if err != nil {
				return err
			}
			if cl.Outcome != "acquired" {
				fmt.Printf("%s: %s, result %s\n", eventID, cl.Outcome, cl.Result)
				return nil
			}
			if fail {
				out, err := q.Fail(ctx, pgxdb.FailParams{Source: "stripe", Key: eventID, Token: cl.Token,
					Error: new("ledger timed out"), Retryable: true})
				fmt.Printf("%s: attempt %d %s\n", eventID, cl.Attempt, out)
				return err
			}
			if _, err := tx.Exec(ctx, `INSERT INTO payments VALUES ($1, $2)`, invoice, cents); err != nil {
				return err
			}
			out, err := q.Complete(ctx, pgxdb.CompleteParams{Source: "stripe", Key: eventID, Token: cl.Token,
				Result: new(`{"invoice": "` + invoice + `"}`)})
			fmt.Printf("%s: attempt %d %s\n", eventID, cl.Attempt, out)
			return err
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	handle("evt_1", "in_1", 1200, true)  // the first delivery fails: released
	handle("evt_1", "in_1", 1200, false) // the sender's retry runs it
	handle("evt_1", "in_1", 1200, false) // a duplicate: replayed

	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM payments`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("payments:", n)
	// Output:
	// evt_1: attempt 1 failed
	// evt_1: attempt 2 completed
	// evt_1: completed, result {"invoice": "in_1"}
	// payments: 1
}
