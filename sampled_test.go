package idem_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testdb"
)

// TestSampledMinuteUnforgeable: idem.claim_weight remembers, in the session
// setting idem.sampled_minute, that a source is above the exact-counting
// rate this minute, and then samples its duplicates (1 in the policy's
// duplicate_sampling, counted that many times). Any role can set a session
// setting (and a transaction-mode pooler carries it to the next client):
// the application role sets it, for a quiet source, as version 23 wrote it
// and as migration 24 writes it with a made-up signature. Every duplicate
// is still counted exactly, once; with the setting taken, 20 duplicates
// sampled 1 in 1000 count 0 or a multiple of 1000.
func TestSampledMinuteUnforgeable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 2)
	role := fmt.Sprintf("sampled_app_%d", time.Now().UnixNano()%1e9)
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` NOLOGIN; SELECT idem.grant_app('`+role+`');
		INSERT INTO idem.policies (source, ttl, lease, duplicate_sampling) VALUES ('quiet', '1 day', '1 minute', 1000)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `DROP OWNED BY `+role+`; DROP ROLE `+role)
	})
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, `SET ROLE `+role); err != nil {
		t.Fatal(err)
	}
	var done string
	if err := conn.QueryRow(ctx, `SELECT idem.complete('quiet', 'done', c.token, '1') FROM idem.claim('quiet', 'done') c`).Scan(&done); err != nil || done != "completed" {
		t.Fatalf("setup: %q %v", done, err)
	}
	counted := func() (n int64) {
		t.Helper()
		if err := admin.QueryRow(ctx, `SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'quiet'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, forged := range []string{"%s", "%s/0123456789abcdef0123456789abcdef"} {
		var tag string
		if err := admin.QueryRow(ctx, `SELECT (extract(epoch FROM idem.activity_minute(idem.clock())))::bigint::text || '/quiet'`).Scan(&tag); err != nil {
			t.Fatal(err)
		}
		before := counted()
		for range 20 {
			if _, err := conn.Exec(ctx, `SELECT set_config('idem.sampled_minute', $1, false)`, fmt.Sprintf(forged, tag)); err != nil {
				t.Fatal(err)
			}
			var outcome string
			if err := conn.QueryRow(ctx, `SELECT outcome FROM idem.claim('quiet', 'done')`).Scan(&outcome); err != nil || outcome != "completed" {
				t.Fatalf("a duplicate: %q %v", outcome, err)
			}
		}
		if got := counted() - before; got != 20 {
			t.Errorf("idem.sampled_minute set by the application to %q: 20 duplicates of a quiet source counted as %d, want 20", fmt.Sprintf(forged, tag), got)
		}
	}
}
