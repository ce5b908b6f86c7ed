package inbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/inbox"
)

// TestQueueStatementsIgnoreOtherRolesObjects: another role that may create
// in schema public (every role could before PostgreSQL 15) plants an
// operator bigint * interval there, which pg_catalog answers only through
// a cast, so an unqualified call of exactly those types picks it. The
// inbox's statements (a job's take with its lease, a replay with its ttl)
// run as the inbox's role, here a superuser: none of them runs it, and
// every event is processed once. Before, each job's take ran it.
func TestQueueStatementsIgnoreOtherRolesObjects(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	other := fmt.Sprintf("queue_other_%d", time.Now().UnixNano()%1e9)
	if _, err := pool.Exec(ctx, `CREATE ROLE `+other+` NOLOGIN; GRANT USAGE, CREATE ON SCHEMA public TO `+other+`;
		CREATE TABLE public.fired (what text, by_role text); GRANT INSERT ON public.fired TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY `+other+`; DROP ROLE `+other)
	})
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = conn.Exec(ctx, `SET ROLE `+other+`;
		CREATE FUNCTION public.evil_mul(bigint, interval) RETURNS interval LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
		BEGIN INSERT INTO public.fired VALUES ('bigint * interval', current_user::text);
		      RETURN $1::double precision OPERATOR(pg_catalog.*) $2; END $$;
		CREATE OPERATOR public.* (LEFTARG = bigint, RIGHTARG = interval, FUNCTION = public.evil_mul);
		RESET ROLE`)
	conn.Release()
	if err != nil {
		t.Fatal(err)
	}
	in, err := inbox.New(inbox.Config{Pool: pool, Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
		return nil, record(ctx, tx, d)
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if _, err := in.Accept(ctx, &inbox.Delivery{Source: "shop", Key: fmt.Sprintf("o-%d", i), Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	start(t, in, 2, nil)
	waitFor(t, "every key completed", func() bool {
		return count(t, pool, `SELECT count(*) FROM idem.processed_events WHERE source = 'shop' AND status = 'completed'`) == 3
	})
	if n := count(t, pool, `SELECT count(*) FROM processed`); n != 3 {
		t.Fatalf("%d events processed, want 3", n)
	}
	rows, err := pool.Query(ctx, `SELECT DISTINCT what || ' as ' || by_role FROM public.fired`)
	if err != nil {
		t.Fatal(err)
	}
	fired, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fired {
		t.Errorf("the inbox's statements ran another role's look-alike: %s", f)
	}
}
