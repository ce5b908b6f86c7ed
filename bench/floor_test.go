package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/pgcluster"
)

// TestFloorWritesWhatTheClaimWrites: the minimal claim and completion of
// the ceiling section (ceiling/floor.sql) write the columns idem.claim and
// idem.complete_stored write, with the default policy's lease and ttl, and
// answer a claimed, a completed and a stale key the way a claim does: the
// floor does the same work, minus the features.
func TestFloorWritesWhatTheClaimWrites(t *testing.T) {
	t.Chdir("..") // claimDatabase reads bench/pgbench/ from the repository root
	ctx := context.Background()
	c, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	_, floor, err := floorDatabases(ctx, server{"smoke", c.URL("postgres"), c.BinDir})
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, floor)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)

	// row is what a key's row holds: its non-null columns, and the values
	// the two must agree on.
	type row struct {
		Columns    []string
		Status     string
		Attempts   int
		Month      time.Time
		Lease, TTL *string
		Result     json.RawMessage
	}
	read := func(t *testing.T, key string) row {
		t.Helper()
		var r row
		if err := conn.QueryRow(ctx, `
			SELECT array(SELECT j.k FROM jsonb_each(to_jsonb(e)) j(k, v) WHERE j.v <> 'null'::jsonb ORDER BY j.k),
			       e.status, e.attempts, e.first_seen_month, (e.lease_expires_at - e.first_seen)::text, (e.expires_at - e.first_seen)::text, e.result
			  FROM idem.processed_events e WHERE e.source = 'cols' AND e.key = $1`, key).
			Scan(&r.Columns, &r.Status, &r.Attempts, &r.Month, &r.Lease, &r.TTL, &r.Result); err != nil {
			t.Fatal(err)
		}
		return r
	}
	same := func(t *testing.T, shipped, floor row) {
		t.Helper()
		if strings.Join(shipped.Columns, ",") != strings.Join(floor.Columns, ",") {
			t.Errorf("columns written: idem's %v, the floor's %v", shipped.Columns, floor.Columns)
		}
		shipped.Columns, floor.Columns = nil, nil
		if s, f, _ := jsonPair(shipped, floor); s != f {
			t.Errorf("row: idem's %s, the floor's %s", s, f)
		}
	}
	claim := func(t *testing.T, fn, key string) (outcome string, token *int64, result []byte) {
		t.Helper()
		if err := conn.QueryRow(ctx, `SELECT outcome, token, result::text FROM `+fn+`('cols', $1)`, key).Scan(&outcome, &token, &result); err != nil {
			t.Fatal(err)
		}
		return
	}

	outcome, shippedToken, _ := claim(t, "idem.claim", "shipped")
	if outcome != "acquired" {
		t.Fatalf("idem.claim: %s", outcome)
	}
	outcome, floorToken, _ := claim(t, "bench_floor_claim", "floor")
	if outcome != "acquired" || floorToken == nil || *floorToken <= 0 {
		t.Fatalf("the floor's claim of a new key: %s, token %v", outcome, floorToken)
	}
	t.Run("claimed", func(t *testing.T) { same(t, read(t, "shipped"), read(t, "floor")) })
	if outcome, token, _ := claim(t, "bench_floor_claim", "floor"); outcome != "in_progress" || token != nil {
		t.Errorf("the floor's claim of a key being worked on: %s, token %v", outcome, token)
	}

	var stored string
	if err := conn.QueryRow(ctx, `SELECT outcome FROM idem.complete_stored('cols', 'shipped', $1, '{"ok": true}')`, *shippedToken).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("idem.complete_stored: %s, %v", outcome, err)
	}
	if err := conn.QueryRow(ctx, `SELECT bench_floor_complete('cols', 'floor', $1, '{"ok": true}')`, *floorToken).Scan(&stored); err != nil || stored != "completed" {
		t.Fatalf("the floor's completion: %s, %v", stored, err)
	}
	t.Run("completed", func(t *testing.T) { same(t, read(t, "shipped"), read(t, "floor")) })
	if outcome, _, result := claim(t, "bench_floor_claim", "floor"); outcome != "completed" || string(result) != `{"ok": true}` {
		t.Errorf("the floor's claim of a completed key: %s, result %s", outcome, result)
	}
	if err := conn.QueryRow(ctx, `SELECT bench_floor_complete('cols', 'floor', $1, '{"ok": true}')`, *floorToken).Scan(&stored); err != nil || stored != "stale_token" {
		t.Errorf("the floor's second completion: %s, %v", stored, err)
	}
}

func jsonPair(a, b any) (string, string, error) {
	x, err := json.Marshal(a)
	if err != nil {
		return "", "", err
	}
	y, err := json.Marshal(b)
	return string(x), string(y), err
}
