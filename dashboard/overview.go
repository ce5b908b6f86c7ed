package dashboard

import (
	"html/template"
	"math"
	"net/http"
	"sort"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/db/pgxdb"
)

// ExactRate is idem.exact_counting_rate() (migration 19): below this many
// claims a minute, a source's every claim is counted in idem.activity;
// at or above it, 1 in the policy's duplicate_sampling, as that many.
const ExactRate = 600

// sourceView is one source's card on the overview.
type sourceView struct {
	Source string
	// Sampling is the policy's duplicate_sampling: above ExactRate claims
	// a minute, 1 in that many claims is counted, as that many (0: none).
	Sampling int32
	// Estimated: some minute of the last 24 hours reached ExactRate with
	// Sampling above 1, so its counts may be sampled; below it every
	// claim is counted (migration 19) and the figures are exact.
	Estimated bool
	// From idem.activity.
	ClaimsPerMinute float64 // over the last 15 minutes
	Rate1h, Rate24h float64 // NaN without claims
	Alert           bool    // Rate1h above the threshold
	Acquired24h     int64
	Duplicates24h   int64
	HourChart       template.HTML
	DayChart        template.HTML
	// From the last snapshot (nil: none taken yet).
	Snapshot *pgxdb.DashSnapshotsRow
	InFlight int64 // processing, lease not ended
	// From the inbox's holds.
	Queued, Dead int64
}

type overviewView struct {
	Sources    []sourceView
	Sort       string // the summary's column (summaryColumns), "" for source
	Desc       bool
	Columns    []summaryColumn
	Threshold  float64
	SnapshotAt time.Time // the oldest snapshot's time; zero: none
	// NextSnapshot: when the next snapshot is due (Config.NextSnapshot);
	// zero: not known.
	NextSnapshot time.Time
	Inbox        bool
}

// summaryColumn is a sortable column of the overview's summary table.
type summaryColumn struct {
	Name, Title string
	value       func(*sourceView) float64
	// Sorted: the table is sorted on it; Desc: descending; Href: the
	// query that sorts on it (the other way when it is the sort).
	Sorted, Desc bool
	Href         string
}

var summaryColumns = []summaryColumn{
	{Name: "claims", Title: "claims / min", value: func(s *sourceView) float64 { return s.ClaimsPerMinute }},
	{Name: "rate1h", Title: "duplicates 1 h", value: func(s *sourceView) float64 { return nanLow(s.Rate1h) }},
	{Name: "rate24h", Title: "duplicates 24 h", value: func(s *sourceView) float64 { return nanLow(s.Rate24h) }},
	{Name: "inflight", Title: "in flight", value: func(s *sourceView) float64 { return float64(s.InFlight) }},
	{Name: "stuck", Title: "stuck", value: func(s *sourceView) float64 { return snap(s, func(x *pgxdb.DashSnapshotsRow) int64 { return x.Stuck }) }},
	{Name: "failed", Title: "failed", value: func(s *sourceView) float64 { return snap(s, func(x *pgxdb.DashSnapshotsRow) int64 { return x.Failed }) }},
	{Name: "queued", Title: "queued", value: func(s *sourceView) float64 { return float64(s.Queued) }},
	{Name: "dead", Title: "dead letters", value: func(s *sourceView) float64 { return float64(s.Dead) }},
}

func nanLow(f float64) float64 {
	if math.IsNaN(f) {
		return -1
	}
	return f
}

func snap(s *sourceView, f func(*pgxdb.DashSnapshotsRow) int64) float64 {
	if s.Snapshot == nil {
		return -1
	}
	return float64(f(s.Snapshot))
}

// sortSummary orders the sources by a summary column (unknown: by name),
// ties by name, and sets each column's link.
func (v *overviewView) sortSummary(by string, desc bool) {
	var col *summaryColumn
	v.Columns = make([]summaryColumn, len(summaryColumns))
	copy(v.Columns, summaryColumns)
	for i := range v.Columns {
		c := &v.Columns[i]
		if c.Name == by {
			col, c.Sorted, c.Desc = c, true, desc
		}
		dir := "desc" // numbers: the largest first on the first click
		if c.Sorted && desc {
			dir = "asc"
		}
		c.Href = "?sort=" + c.Name + "&dir=" + dir
	}
	if col == nil {
		v.Sort, v.Desc = "", false
		return
	}
	v.Sort, v.Desc = by, desc
	sort.SliceStable(v.Sources, func(i, j int) bool {
		a, b := col.value(&v.Sources[i]), col.value(&v.Sources[j])
		if a == b {
			return v.Sources[i].Source < v.Sources[j].Source
		}
		return (a < b) != desc
	})
}

func (d *Dashboard) overview(w http.ResponseWriter, r *http.Request) {
	p, cancel, ok := d.page(w, r)
	defer cancel()
	if !ok {
		return
	}
	ctx, q, now := p.ctx, p.q, p.now
	activity, err := q.DashActivity(ctx, pgxdb.DashActivityParams{BucketSeconds: 60,
		Since: pgtype.Timestamptz{Time: now.Add(-24 * time.Hour).Truncate(time.Minute), Valid: true}})
	if err != nil {
		d.fail(w, r, "activity", err)
		return
	}
	policies, err := q.DashPolicies(ctx)
	if err != nil {
		d.fail(w, r, "policies", err)
		return
	}
	snaps, err := q.DashSnapshots(ctx)
	if err != nil {
		d.fail(w, r, "snapshots", err)
		return
	}
	holds, err := q.DashHolds(ctx)
	if err != nil {
		d.fail(w, r, "holds", err)
		return
	}
	v := buildOverview(now, d.cfg.DuplicateAlert, activity, policies, snaps, holds)
	v.Inbox = d.cfg.Inbox != nil
	if d.cfg.NextSnapshot != nil {
		v.NextSnapshot = d.cfg.NextSnapshot()
	}
	v.sortSummary(r.URL.Query().Get("sort"), r.URL.Query().Get("dir") == "desc")
	d.renderLive(w, r, http.StatusOK, "overview", "overview", "Overview", now, v)
}

// buildOverview folds the rows into one card per source: every source that
// has a policy, activity, a snapshot or holds.
func buildOverview(now time.Time, threshold float64, activity []pgxdb.DashActivityRow, policies []pgxdb.DashPoliciesRow,
	snaps []pgxdb.DashSnapshotsRow, holds []pgxdb.DashHoldsRow) overviewView {
	cards := map[string]*sourceView{}
	card := func(source string) *sourceView {
		c, ok := cards[source]
		if !ok {
			c = &sourceView{Source: source, Sampling: -1}
			cards[source] = c
		}
		return c
	}
	defaultSampling := int32(8)
	for _, p := range policies {
		if p.Source == "*" {
			defaultSampling = p.DuplicateSampling
			continue
		}
		card(p.Source).Sampling = p.DuplicateSampling
	}
	perSource := map[string][]pgxdb.DashActivityRow{}
	busy := map[string]bool{} // a minute at or above ExactRate
	for _, a := range activity {
		card(a.Source)
		perSource[a.Source] = append(perSource[a.Source], a)
		if a.Acquired+a.Duplicates >= ExactRate {
			busy[a.Source] = true
		}
	}
	v := overviewView{Threshold: threshold}
	for i := range snaps {
		s := &snaps[i]
		c := card(s.Source)
		c.Snapshot = s
		c.InFlight = s.Processing - s.Stuck
		if v.SnapshotAt.IsZero() || s.TakenAt.Time.Before(v.SnapshotAt) {
			v.SnapshotAt = s.TakenAt.Time
		}
	}
	for _, h := range holds {
		c := card(h.Source)
		c.Queued, c.Dead = h.Queued, h.Dead
	}
	end := now.Truncate(time.Minute).Add(time.Minute) // the current minute included
	for _, c := range cards {
		if c.Sampling < 0 {
			c.Sampling = defaultSampling
		}
		c.Estimated = c.Sampling > 1 && busy[c.Source]
		hour := buckets(perSource[c.Source], end.Add(-time.Hour), time.Minute, 60)
		day := buckets(perSource[c.Source], end.Add(-24*time.Hour), 30*time.Minute, 48)
		var last15 int64
		for _, b := range hour[45:] {
			last15 += b.Claims
		}
		c.ClaimsPerMinute = float64(last15) / 15
		c.Rate1h, c.Rate24h = total(hour).rate(), total(day).rate()
		c.Alert = !math.IsNaN(c.Rate1h) && c.Rate1h > threshold
		t := total(day)
		c.Acquired24h, c.Duplicates24h = t.Claims-t.Duplicates, t.Duplicates
		c.HourChart = chart(c.Source+": the last hour", hour, time.Minute, threshold, "-1h")
		c.DayChart = chart(c.Source+": the last 24 hours", day, 30*time.Minute, threshold, "-24h")
		v.Sources = append(v.Sources, *c)
	}
	sort.Slice(v.Sources, func(i, j int) bool { return v.Sources[i].Source < v.Sources[j].Source })
	return v
}

// buckets sums a source's minutes into n buckets of step from start.
func buckets(rows []pgxdb.DashActivityRow, start time.Time, step time.Duration, n int) []bucket {
	out := make([]bucket, n)
	for i := range out {
		out[i].Start = start.Add(time.Duration(i) * step)
	}
	for _, a := range rows {
		i := int(a.Bucket.Time.Sub(start) / step)
		if a.Bucket.Time.Before(start) || i >= n {
			continue
		}
		out[i].Claims += a.Acquired + a.Duplicates
		out[i].Duplicates += a.Duplicates
	}
	return out
}

func total(bs []bucket) bucket {
	var t bucket
	for _, b := range bs {
		t.Claims += b.Claims
		t.Duplicates += b.Duplicates
	}
	return t
}
