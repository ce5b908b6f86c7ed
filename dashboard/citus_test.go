package dashboard_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/dashboard"
	"github.com/idemkit/idem/internal/prune"
	"github.com/idemkit/idem/internal/testdb"
)

// TestCitusDashboard (migration 19, opt-in: docs/citus.md): on a
// distributed idem, a source with 2 keys and 18 duplicates, claimed on the
// workers with the default sampling (1 in 8), is counted exactly once the
// next prune collects the workers' counts (2 acquired, 18 duplicates, not
// "~56"), and every page of the dashboard, served from the coordinator,
// answers 200; the keys page lists both keys.
func TestCitusDashboard(t *testing.T) {
	url := testdb.Citus(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, `INSERT INTO idem.policies (source, ttl, lease) VALUES ('shop', '1 day', '1 minute')`); err != nil {
		t.Fatal(err)
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	keys := []string{"order-1", "order-2"}
	for i := range 20 {
		key := keys[i%2]
		if _, err := c.Do(ctx, "shop", key, func(context.Context) (any, error) { return key, nil }); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := prune.Run(ctx, pool, prune.Config{}); err != nil {
		t.Fatal(err)
	}
	var acquired, dups int64
	if err := pool.QueryRow(ctx, `SELECT (SELECT coalesce(sum(acquired), 0) FROM idem.activity WHERE source = 'shop'),
		(SELECT coalesce(sum(duplicates), 0) FROM idem.duplicate_counts WHERE source = 'shop')`).Scan(&acquired, &dups); err != nil {
		t.Fatal(err)
	}
	if acquired != 2 || dups != 18 {
		t.Fatalf("counted on the coordinator after a prune: %d acquired, %d duplicates; want 2 and 18", acquired, dups)
	}
	d, err := dashboard.New(dashboard.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(d)
	t.Cleanup(srv.Close)
	for _, path := range []string{"/", "/keys", "/keys?source=shop", "/timeline?source=shop&key=order-1", "/maintenance", "/dead", "/jobs"} {
		t.Run(path, func(t *testing.T) {
			resp, err := http.Get(srv.URL + path)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("GET %s: %d %s", path, resp.StatusCode, body)
			}
			if strings.HasPrefix(path, "/keys") {
				for _, k := range keys {
					if !strings.Contains(string(body), k) {
						t.Errorf("GET %s does not list %s", path, k)
					}
				}
			}
			if path == "/" && !strings.Contains(string(body), "shop") {
				t.Errorf("the overview does not show source shop")
			}
		})
	}
}
