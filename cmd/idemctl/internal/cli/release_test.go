package cli

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestReleaseCommand: a completed key is released and runs again; a key
// not stored is nothing to release; a key in progress is refused (exit 1,
// ID004), as is a call without its flags (usage); the maintainer role may
// release.
func TestReleaseCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.Pool(t, url, 2)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	work := func(context.Context) (any, error) { runs++; return nil, nil }
	_, _ = c.Do(ctx, "s", "done", work)
	start := time.Now()
	if r := idemctl(t, ctx, nil, "release", "--database-url", url, "--source", "s", "--key", "done"); r.code != 0 || !strings.HasPrefix(r.out, "released s/done (1 row(s))") {
		t.Fatalf("release: %+v", r)
	}
	if d := time.Since(start); d < idem.ReleaseGrace {
		t.Fatalf("release returned after %v, before the caches' grace", d)
	}
	_, _ = c.Do(ctx, "s", "done", work)
	if runs != 2 {
		t.Fatalf("runs %d after the release, want 2", runs)
	}
	if r := idemctl(t, ctx, nil, "release", "--database-url", url, "--source", "s", "--key", "never"); r.code != 0 || !strings.HasPrefix(r.out, "nothing to release") {
		t.Fatalf("release of a key not stored: %+v", r)
	}
	_, _ = c.Claim(ctx, "s", "busy")
	if r := idemctl(t, ctx, nil, "release", "--database-url", url, "--source", "s", "--key", "busy"); r.code != ExitError || !strings.Contains(r.errout, "in progress") || !strings.Contains(r.errout, "ID004") {
		t.Fatalf("release of a key in progress: %+v", r)
	}
	if r := idemctl(t, ctx, nil, "release", "--database-url", url, "--source", "s"); r.code != ExitUsage {
		t.Fatalf("release without --key: %+v", r)
	}
	role := fmt.Sprintf("idem_rel_%d", time.Now().UnixNano())
	if _, err := pool.Exec(ctx, `CREATE ROLE `+role); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), `DROP OWNED BY `+role)
		_, _ = pool.Exec(context.Background(), `DROP ROLE `+role)
	})
	if _, err := pool.Exec(ctx, `SELECT idem.grant_maintainer($1::regrole)`, role); err != nil {
		t.Fatal(err)
	}
	var ok bool
	if err := pool.QueryRow(ctx, `SELECT has_function_privilege($1, 'idem.release(text, text)', 'EXECUTE')`, role).Scan(&ok); err != nil || !ok {
		t.Fatalf("the maintainer cannot release: %v", err)
	}
}
