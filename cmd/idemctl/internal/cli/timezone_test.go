package cli

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// TestTimeZones: claims, partitions, check and rotation give the same
// answers whatever the server's TimeZone, here set on the database the way
// an operator sets it for a server (ALTER DATABASE ... SET timezone), with
// claims half an hour either side of a UTC month boundary: in
// America/Adak (UTC-10) both fall on the earlier local day, in
// Pacific/Kiritimati (UTC+14) both on the later one.
func TestTimeZones(t *testing.T) {
	t.Parallel()
	boundary := testdb.MonthStart(time.Now(), 1)
	var want string
	for _, tz := range []string{"UTC", "America/Adak", "Pacific/Kiritimati"} {
		t.Run(tz, func(t *testing.T) {
			got := timeZoneAnswers(t, tz, boundary)
			if tz == "UTC" {
				want = got
				return
			}
			if got != want {
				t.Fatalf("with TimeZone %s:\n%s\nwith UTC:\n%s", tz, got, want)
			}
		})
	}
}

// timeZoneAnswers runs claims, rotation, list and check on a fresh
// database whose TimeZone is tz and returns what they answered.
func timeZoneAnswers(t *testing.T, tz string, boundary time.Time) string {
	ctx := context.Background()
	url := testdb.New(t)
	admin := testdb.Pool(t, url, 1)
	var db string
	if err := admin.QueryRow(ctx, `SELECT current_database()`).Scan(&db); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s SET timezone TO '%s'", pgx.Identifier{db}.Sanitize(), tz)); err != nil {
		t.Fatal(err)
	}
	before, after := boundary.Add(-30*time.Minute), boundary.Add(30*time.Minute)
	var b strings.Builder
	for i, at := range []time.Time{before, after} {
		pool := testdb.PoolAt(t, url, 2, at)
		var sessionTZ string
		if err := pool.QueryRow(ctx, `SHOW timezone`).Scan(&sessionTZ); err != nil || sessionTZ != tz {
			t.Fatalf("session TimeZone %q (%v), want %q", sessionTZ, err, tz)
		}
		c, err := idem.New(pool, nil)
		if err != nil {
			t.Fatal(err)
		}
		key := fmt.Sprintf("k%d", i)
		cl, err := c.Claim(ctx, "tz", key)
		if err != nil || cl.Outcome != idem.Acquired {
			t.Fatalf("claim: %+v %v", cl, err)
		}
		if err := c.Complete(ctx, "tz", key, cl.Token, nil); err != nil {
			t.Fatal(err)
		}
	}
	rows, err := admin.Query(ctx, `SELECT key || ' ' || first_seen_month::text || ' ' || tableoid::regclass::text
	                                  FROM idem.processed_events ORDER BY key`)
	if err != nil {
		t.Fatal(err)
	}
	claims, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(&b, "claims: %v\n", claims)

	// The operator's commands, their sessions living just after the boundary.
	param := testdb.ClockParam + "=" + after.Format(time.RFC3339Nano)
	at := url + " " + param // keyword/value form
	switch {
	case strings.Contains(url, "://") && strings.Contains(url, "?"):
		at = url + "&" + param
	case strings.Contains(url, "://"):
		at = url + "?" + param
	}
	for _, args := range [][]string{
		{"partitions", "rotate", "--premake", "3"},
		{"partitions", "list"},
		{"check", "--min-premade", "3"},
	} {
		r := idemctl(t, ctx, nil, append(args, "--database-url", at)...)
		if r.code != 0 {
			t.Fatalf("%v: %+v", args, r)
		}
		fmt.Fprintf(&b, "%v: %s\n", args, stripSizes(r.out))
	}
	return b.String()
}

// stripSizes drops the columns of `partitions list` that vary with
// storage (sizes), keeping names and month bounds.
func stripSizes(out string) string {
	var lines []string
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		f := strings.Fields(l)
		if len(f) > 3 {
			f = f[:3]
		}
		lines = append(lines, strings.Join(f, " "))
	}
	return strings.Join(lines, " | ")
}
