package sqldb_test

import (
	"context"
	"database/sql"
	"fmt"
	"log"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver; lib/pq works too

	"github.com/idemkit/idem/db/sqldb"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// The database/sql accessors inside the application's own *sql.Tx: claim,
// write, complete, one commit. A duplicate delivered meanwhile waits for
// that commit (up to the claim's lock_wait), then replays the result.
func Example() {
	ctx := context.Background()
	url, drop, err := testdb.Create() // in an application: os.Getenv("DATABASE_URL")
	if err != nil {
		log.Fatal(err)
	}
	defer drop()
	db, err := sql.Open("pgx", url)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, `CREATE TABLE shipments (order_id text PRIMARY KEY)`); err != nil {
		log.Fatal(err)
	}

	handle := func(key, order string) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer tx.Rollback()
		q := sqldb.New(tx) // or sqldb.New(db).WithTx(tx)
		cl, err := q.Claim(ctx, sqldb.ClaimParams{Source: "shop", Key: key,
			Fingerprint: sql.NullString{String: "order=" + order, Valid: true}})
		if err != nil {
			return err
		}
		switch cl.Outcome {
		case "acquired":
		case "completed":
			fmt.Printf("%s: replayed %s\n", key, cl.Result.RawMessage)
			return tx.Commit()
		default: // in_progress, mismatch, failed
			fmt.Printf("%s: %s\n", key, cl.Outcome)
			return tx.Commit()
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO shipments VALUES ($1)`, order); err != nil {
			return err
		}
		out, err := q.Complete(ctx, sqldb.CompleteParams{Source: "shop", Key: key, Token: cl.Token,
			Result: sql.NullString{String: `{"shipped": "` + order + `"}`, Valid: true}})
		if err != nil {
			return err
		}
		fmt.Printf("%s: %s\n", key, out)
		return tx.Commit()
	}
	for _, d := range [][2]string{{"ord-7", "7"}, {"ord-7", "7"}, {"ord-7", "8"}} {
		if err := handle(d[0], d[1]); err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// ord-7: completed
	// ord-7: replayed {"shipped": "7"}
	// ord-7: mismatch
}
