package main

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/migrate"
)

// TestYearSmall runs the year section at a tiny size: 2,000 keys over 365
// simulated days, two weeks per tick, one maintenance run in six killed
// (SIGTERM or SIGKILL), the database restarted once during maintenance,
// the schema upgraded from the previous version a month in (maintained
// until then by pg_cron's CALLs through psql, killed alike), and
// the ttl of one source cut mid-year. It fails on any correctness
// violation the section checks (a key's work run twice within its ttl, a
// failed or expired key not run again, a table or lock a killed run left
// after the next scheduled run, or one that idemctl check does not report
// meanwhile). It measures nothing.
func TestYearSmall(t *testing.T) {
	t.Chdir("..") // idemctl is built from the repository root
	var log strings.Builder
	c := yearConfig{keys: 2000, days: 365, daysPerTick: 14, killProb: 1.0 / 6,
		migrateDay: 30, restartDay: 240, readsEvery: 60, seed: 56, log: &log}
	c.defaults(false)
	// A kill lands at a random moment of a run; when every run of a year
	// ends before its kill (a quick machine), the year is run again with
	// the next seed, up to three years: each must hold every check.
	var rep *yearReport
	var md string
	killed := 0
	for try := 0; try < 3 && killed == 0; try++ {
		var err error
		log.Reset()
		if rep, err = runYear(context.Background(), c); err != nil {
			t.Fatalf("%v\n%s", err, log.String())
		}
		md = rep.markdown(c)
		t.Log("\n" + md)
		if rep.totalViolations > 0 {
			t.Fatalf("%d violations:\n%s", rep.totalViolations, strings.Join(rep.violations, "\n"))
		}
		if len(rep.months) != 12 {
			t.Errorf("%d months reported, want 12", len(rep.months))
		}
		for _, n := range rep.kills {
			killed += n
		}
		c.seed++
	}
	if killed == 0 {
		t.Error("no maintenance run was killed in three years")
	}
	for _, want := range []string{"database restarted during maintenance", "migrate up " + itoa(migrate.Latest()-1), "ttl 90d→30d"} {
		if !strings.Contains(md, want) {
			t.Errorf("no %q in the report", want)
		}
	}
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
