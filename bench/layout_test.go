package main

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/pgcluster"
)

// TestLayoutSmall runs the layout section at a tiny size: 2,600 keys over
// its 13 simulated months in each of the four layouts. It fails when
// retention removed a live row in any layout, when a layout's claim does
// not find a live row (one extended past retention, one of the 10-year
// source, or one in 50 of the rest), when a new key is not acquired or
// its duplicate not answered, or when a step of the upgrade prototype is
// refused. It measures nothing.
func TestLayoutSmall(t *testing.T) {
	defer func(k, c int) { layoutKeys, layoutClaims = k, c }(layoutKeys, layoutClaims)
	layoutKeys, layoutClaims = 2600, 50
	if err := benchLayout(context.Background(), nil, options{duration: 200 * time.Millisecond}, nil); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + layoutTable)
	for _, l := range layouts {
		if !strings.Contains(layoutTable, l.name) {
			t.Errorf("no row of %s in the report", l.name)
		}
	}
	if !strings.Contains(layoutTable, "0 of ") {
		t.Error("the upgrade rewrote a leaf")
	}
}

// TestLayoutPostgresBehaviour checks the two PostgreSQL behaviours the
// choice of layout B leans on (docs/design.md, "Retention layout"): an
// INSERT .. ON CONFLICT DO NOTHING through a parent that has no key of its
// own still meets the key of the leaf it inserts into (the upgrade's
// parent with no key), and an UPDATE by token of a row that rotation moved
// to another partition meanwhile is refused with SQLSTATE 40001 (what a
// complete racing a move sees).
func TestLayoutPostgresBehaviour(t *testing.T) {
	ctx := context.Background()
	cl, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Stop()
	a, err := pgx.Connect(ctx, cl.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close(ctx)
	b, err := pgx.Connect(ctx, cl.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close(ctx)
	if _, err := a.Exec(ctx, `
		CREATE TABLE ev (source text NOT NULL, key text NOT NULL, retire_month date NOT NULL, token bigint NOT NULL)
		  PARTITION BY RANGE (retire_month);
		CREATE TABLE ev_01 PARTITION OF ev FOR VALUES FROM ('2026-01-01') TO ('2026-02-01');
		CREATE TABLE ev_02 PARTITION OF ev FOR VALUES FROM ('2026-02-01') TO ('2026-03-01');
		ALTER TABLE ev_01 ADD PRIMARY KEY (source, key, retire_month);
		ALTER TABLE ev_02 ADD PRIMARY KEY (source, key, retire_month);
		INSERT INTO ev VALUES ('s', 'k', '2026-01-01', 1)`); err != nil {
		t.Fatal(err)
	}
	t.Run("the leaf's key meets ON CONFLICT DO NOTHING through a parent with none", func(t *testing.T) {
		tag, err := a.Exec(ctx, `INSERT INTO ev VALUES ('s', 'k', '2026-01-01', 2) ON CONFLICT DO NOTHING`)
		if err != nil {
			t.Fatal(err)
		}
		if tag.RowsAffected() != 0 {
			t.Fatalf("inserted %d rows over the leaf's key", tag.RowsAffected())
		}
	})
	t.Run("an update by token of a row moved meanwhile is refused with 40001", func(t *testing.T) {
		tx, err := a.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx) //nolint:errcheck
		if _, err := tx.Exec(ctx, `UPDATE ev SET retire_month = '2026-02-01' WHERE source = 's' AND key = 'k' AND retire_month = '2026-01-01'`); err != nil {
			t.Fatal(err)
		}
		var bPid int
		if err := b.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&bPid); err != nil {
			t.Fatal(err)
		}
		watch, err := pgx.Connect(ctx, cl.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer watch.Close(ctx)
		done := make(chan error, 1)
		go func() {
			_, err := b.Exec(ctx, `UPDATE ev SET token = 3 WHERE source = 's' AND key = 'k' AND token = 1`)
			done <- err
		}()
		// The update by token waits for the move's transaction.
		for i := 0; ; i++ {
			var waiting bool
			if err := watch.QueryRow(ctx, `SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1`, bPid).Scan(&waiting); err != nil {
				t.Fatal(err)
			}
			if waiting {
				break
			}
			if i > 500 {
				t.Fatal("the update by token never waited for the move")
			}
			time.Sleep(10 * time.Millisecond)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		err = <-done
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "40001" {
			t.Fatalf("update by token after the move: %v, want SQLSTATE 40001", err)
		}
	})
}
