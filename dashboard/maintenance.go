package dashboard

import (
	"encoding/json"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/internal/maintlock"
)

// defaultCap is how far the default partition's rows are counted.
const defaultCap = 10000

type partitionView struct {
	pgxdb.DashPartitionsRow
	Month   string
	Current bool
	Ahead   bool
}

type runView struct {
	pgxdb.DashRunsRow
	Took    time.Duration
	Summary string // the figures, "deleted 1,234 · batches 3"
}

type maintenanceView struct {
	Partitions   []partitionView
	MonthsAhead  int
	DefaultRows  int64
	DefaultOver  bool // more than defaultCap
	Policies     []pgxdb.DashPoliciesRow
	Runs         map[string][]runView
	Jobs         []string
	Locks        []pgxdb.IdemMaintenanceLock
	TotalBytes   int64
	EstimatedAll int64
}

func (d *Dashboard) maintenance(w http.ResponseWriter, r *http.Request) {
	p, cancel, ok := d.page(w, r)
	defer cancel()
	if !ok {
		return
	}
	ctx, q, now := p.ctx, p.q, p.now
	parts, err := q.DashPartitions(ctx)
	if err != nil {
		d.fail(w, r, "partitions", err)
		return
	}
	v := maintenanceView{Runs: map[string][]runView{}, Jobs: []string{"prune", "rotate", "snapshot"}}
	month := time.Date(now.UTC().Year(), now.UTC().Month(), 1, 0, 0, 0, 0, time.UTC)
	for _, part := range parts {
		pv := partitionView{DashPartitionsRow: part, Month: "default"}
		if !part.IsDefault {
			pv.Month = part.MonthFrom.Time.Format("2006-01")
			pv.Current = part.MonthFrom.Time.Equal(month)
			pv.Ahead = part.MonthFrom.Time.After(month)
			if pv.Ahead {
				v.MonthsAhead++
			}
		}
		v.TotalBytes += part.TotalBytes
		if part.EstRows > 0 {
			v.EstimatedAll += part.EstRows
		}
		v.Partitions = append(v.Partitions, pv)
	}
	if v.DefaultRows, err = q.DashDefaultRows(ctx, defaultCap); err != nil {
		d.fail(w, r, "the default partition", err)
		return
	}
	v.DefaultOver = v.DefaultRows > defaultCap
	v.DefaultRows = min(v.DefaultRows, defaultCap)
	if v.Policies, err = q.DashPolicies(ctx); err != nil {
		d.fail(w, r, "policies", err)
		return
	}
	runs, err := q.DashRuns(ctx, 10)
	if err != nil {
		d.fail(w, r, "runs", err)
		return
	}
	for _, run := range runs {
		// Stored by SafeError; Scrub again what an older idemctl or a
		// procedure stored word for word.
		run.Error = maintlock.Scrub(run.Error)
		v.Runs[run.Job] = append(v.Runs[run.Job], runView{DashRunsRow: run,
			Took: run.FinishedAt.Time.Sub(run.StartedAt.Time), Summary: summarize(run.Figures)})
	}
	if v.Locks, err = q.DashLocks(ctx); err != nil {
		d.fail(w, r, "locks", err)
		return
	}
	d.render(w, r, http.StatusOK, "maintenance", "maintenance", "Partitions and maintenance", now, v)
}

// summarize prints a run's figures as "key value · key value", numbers with
// thousands separators.
func summarize(figures string) string {
	var m map[string]any
	if err := json.Unmarshal([]byte(figures), &m); err != nil || len(m) == 0 {
		return ""
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		val := m[k]
		s := ""
		switch x := val.(type) {
		case float64:
			s = formatInt(int64(x))
		case string:
			s = truncate(x, 60)
		default:
			b, _ := json.Marshal(x)
			s = truncate(string(b), 60)
		}
		parts = append(parts, strings.ReplaceAll(k, "_", " ")+" "+s)
	}
	return strings.Join(parts, " · ")
}
