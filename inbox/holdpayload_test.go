package inbox_test

import (
	"context"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

// TestRedeliveryDropsDeadPayload: a delivery whose job dead-lettered kept
// its payload (idem.queue_keep_payload); the event is delivered again, and
// the redelivery takes the dead letter's hold over (idem.queue_hold) for
// its own job, which is lost before it keeps its payload
// (idem.queue_repair with no new job). The hold is dead under the
// redelivery's token: its payload is not the first delivery's, which was
// listed as kept for the new token and replayed (issue 53; migration 24).
func TestRedeliveryDropsDeadPayload(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.Pool(t, testdb.New(t), 2)
	var first, second int64
	if err := pool.QueryRow(ctx, `SELECT token FROM idem.claim('hooks', 'evt_1')`).Scan(&first); err != nil {
		t.Fatal(err)
	}
	var state string
	if _, err := pool.Exec(ctx, `SELECT idem.queue_hold('hooks', 'evt_1', $1, 101)`, first); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT idem.queue_fail('hooks', 'evt_1', $1, $1, 'boom', true)`, first).Scan(&state); err != nil || state != "dead" {
		t.Fatalf("the first delivery's job dead-lettered: %q %v", state, err)
	}
	var kept bool
	if err := pool.QueryRow(ctx, `SELECT idem.queue_keep_payload('hooks', 'evt_1', $1, '{"body": "first"}')`, first).Scan(&kept); err != nil || !kept {
		t.Fatalf("the dead letter's payload kept: %v %v", kept, err)
	}
	if err := pool.QueryRow(ctx, `SELECT token FROM idem.claim('hooks', 'evt_1')`).Scan(&second); err != nil || second == first {
		t.Fatalf("the redelivery: token %d (first %d) %v", second, first, err)
	}
	var took int64
	if err := pool.QueryRow(ctx, `SELECT idem.queue_hold('hooks', 'evt_1', $1, 102)`, second).Scan(&took); err != nil || took != 101 {
		t.Fatalf("the redelivery's hold took over job %d (%v), want the dead letter's 101", took, err)
	}
	if err := pool.QueryRow(ctx, `SELECT idem.queue_repair('hooks', 'evt_1', $1, 102, NULL, 'the job was lost')`, second).Scan(&state); err != nil || state != "dead" {
		t.Fatalf("repair: %q %v", state, err)
	}
	var token int64
	var payload *string
	if err := pool.QueryRow(ctx, `SELECT token, payload::text FROM idem.holds WHERE source = 'hooks' AND key = 'evt_1'`).Scan(&token, &payload); err != nil {
		t.Fatal(err)
	}
	if token != second || payload != nil {
		kept := "none"
		if payload != nil {
			kept = *payload
		}
		t.Fatalf("the dead hold: token %d (the redelivery's is %d), payload %s; want the redelivery's token and no payload (the first delivery's is not this one's)", token, second, kept)
	}
}
