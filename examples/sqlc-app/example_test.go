package sqlcapp_test

import (
	"context"
	"fmt"
	"log"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/examples/sqlc-app/appdb"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) { testdb.Main(m) }

// An application's own sqlc package (appdb, generated from sqlc.yaml here)
// claims, writes and completes in one transaction: the order is created
// once however many times the event is delivered.
func Example() {
	ctx := context.Background()
	pool, done := testdb.ExamplePool() // in an application: pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	defer done()
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (order_id text PRIMARY KEY, customer text NOT NULL, total_cents integer NOT NULL)`); err != nil {
		log.Fatal(err)
	}

	deliver := func(eventID string) {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			q := appdb.New(tx)
			cl, err := q.ClaimDelivery(ctx, appdb.ClaimDeliveryParams{Source: "shopify", Key: eventID})
			if err != nil || cl.Outcome != "acquired" {
				fmt.Printf("%s: %s %s\n", eventID, cl.Outcome, cl.Result)
				return err
			}
			if err := q.CreateOrder(ctx, appdb.CreateOrderParams{OrderID: "o-" + eventID, Customer: "c1", TotalCents: 4200}); err != nil {
				return err
			}
			out, err := q.CompleteDelivery(ctx, appdb.CompleteDeliveryParams{Source: "shopify", Key: eventID, Token: cl.Token,
				Result: []byte(`{"order": "o-` + eventID + `"}`)})
			fmt.Printf("%s: %s\n", eventID, out)
			return err
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	for _, id := range []string{"evt_1", "evt_1", "evt_2", "evt_1"} {
		deliver(id)
	}
	sum, err := appdb.New(pool).OrdersByCustomer(ctx, "c1")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("orders %d, %d cents\n", sum.Orders, sum.Cents)
	// Output:
	// evt_1: completed
	// evt_1: completed {"order": "o-evt_1"}
	// evt_2: completed
	// evt_1: completed {"order": "o-evt_1"}
	// orders 2, 8400 cents
}
