package dashboard

import (
	"fmt"
	"net/http"
	"sort"
	"strings"
	"time"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
)

// event is one line of a key's timeline.
type event struct {
	At    time.Time
	Kind  string // a CSS class: claim, lease, effect, done, failed, dead, replay, job
	What  string
	Extra string
}

type timelineView struct {
	Source, Key string
	Found       bool
	Events      []event
	Rows        []pgxdb.DashKeyRow
	Jobs        []inbox.JobInfo
	Inbox       bool
}

// timeline is one event's story, from its key (or a dead letter's): what
// idem and River record of it, in time order.
func (d *Dashboard) timeline(w http.ResponseWriter, r *http.Request) {
	form := r.URL.Query()
	v := timelineView{Source: form.Get("source"), Key: form.Get("key"), Inbox: d.cfg.Inbox != nil}
	if v.Source == "" || v.Key == "" || len(v.Source) > 64 || len(v.Key) > 512 {
		d.badRequest(w, r, "keys", "a timeline needs a source (at most 64 bytes) and a key (at most 512)")
		return
	}
	for _, f := range [][2]string{{"source", v.Source}, {"key", v.Key}} {
		if err := checkText(f[0], f[1]); err != nil {
			d.badRequest(w, r, "keys", "%v", err)
			return
		}
	}
	p, cancel, ok := d.page(w, r)
	defer cancel()
	if !ok {
		return
	}
	ctx, q := p.ctx, p.q
	var err error
	if v.Rows, err = q.DashKey(ctx, pgxdb.DashKeyParams{Source: v.Source, Key: v.Key}); err != nil {
		d.fail(w, r, "the key", err)
		return
	}
	holds, err := q.DashKeyHold(ctx, pgxdb.DashKeyHoldParams{Source: v.Source, Key: v.Key})
	if err != nil {
		d.fail(w, r, "the key's hold", err)
		return
	}
	effects, err := q.DashKeyEffects(ctx, pgxdb.DashKeyEffectsParams{Source: v.Source, Key: v.Key})
	if err != nil {
		d.fail(w, r, "the key's effects", err)
		return
	}
	if d.cfg.Inbox != nil {
		if v.Jobs, err = d.cfg.Inbox.KeyJobs(ctx, v.Source, v.Key); err != nil {
			d.fail(w, r, "the key's jobs", err)
			return
		}
	}
	v.Events = buildTimeline(p.now, v.Rows, holds, effects, v.Jobs)
	v.Found = len(v.Rows) > 0 || len(holds) > 0 || len(v.Jobs) > 0
	d.renderLive(w, r, http.StatusOK, "timeline", "keys", "Timeline", p.now, v)
}

// buildTimeline orders what is recorded of one key by time.
func buildTimeline(now time.Time, rows []pgxdb.DashKeyRow, holds []pgxdb.DashKeyHoldRow, effects []pgxdb.DashKeyEffectsRow, jobs []inbox.JobInfo) []event {
	var ev []event
	add := func(at time.Time, kind, what, extra string) {
		if !at.IsZero() {
			ev = append(ev, event{At: at, Kind: kind, What: what, Extra: extra})
		}
	}
	for _, e := range rows {
		add(e.FirstSeen.Time, "claim", "first seen: claimed, attempt 1", "month "+e.FirstSeenMonth.Time.Format("2006-01"))
		if e.Attempts > 1 {
			add(e.UpdatedAt.Time, "claim", fmt.Sprintf("last change: %d attempts in all", e.Attempts), "each claim that took the key over is one attempt; only the last change's time is kept")
		}
		if e.Status == "processing" && e.LeaseExpiresAt.Valid {
			what := "lease held until"
			if e.LeaseExpiresAt.Time.Before(now) {
				what = "lease ended (stuck: processing past its lease)"
			}
			add(e.LeaseExpiresAt.Time, "lease", what, fmt.Sprintf("attempt %d", e.Attempts))
		}
		switch {
		case e.CompletedAt.Valid:
			add(e.CompletedAt.Time, "done", "completed", fmt.Sprintf("result %s", formatBytes(e.ResultBytes)))
		case e.Status == "failed":
			add(e.UpdatedAt.Time, "failed", "failed", truncate(e.LastError, 200))
		}
		if e.Duplicates > 0 {
			add(e.UpdatedAt.Time, "claim", fmt.Sprintf("%d duplicate deliveries counted", e.Duplicates), "the policy's count_per_key")
		}
		add(e.ExpiresAt.Time, "expiry", "expires: pruned after this", "")
	}
	for _, h := range holds {
		add(h.HeldAt.Time, "job", "held by the inbox (queued for its job)", "")
		if h.State == "dead" {
			add(h.DeadAt.Time, "dead", "dead-lettered", truncate(h.Error, 200))
		}
	}
	for _, e := range effects {
		name, _, _ := strings.Cut(e.Key, "/")
		add(e.FirstSeen.Time, "effect", "effect "+name+" started", fmt.Sprintf("%d attempts", e.Attempts))
		if e.CompletedAt.Valid {
			add(e.CompletedAt.Time, "effect", "effect "+name+" recorded", e.Status)
		} else if e.LastError != "" {
			add(e.FirstSeen.Time, "failed", "effect "+name+" "+e.Status, truncate(e.LastError, 200))
		}
	}
	for _, j := range jobs {
		kind, what := "job", fmt.Sprintf("job %d enqueued", j.ID)
		if j.Replay {
			kind, what = "replay", fmt.Sprintf("replayed: job %d enqueued, replacing the dead letter's job %d (its attempts are gone with it)", j.ID, j.ReplayOf)
		}
		add(j.CreatedAt, kind, what, "")
		for _, e := range j.Errors {
			add(e.At, "failed", fmt.Sprintf("job %d attempt %d failed", j.ID, e.Attempt), truncate(e.Error, 200))
		}
		switch j.State {
		case "running":
			add(j.AttemptedAt, "job", fmt.Sprintf("job %d attempt %d of %d running", j.ID, j.Attempt, j.MaxAttempts), "")
		case "retryable", "scheduled":
			add(j.ScheduledAt, "lease", fmt.Sprintf("job %d next attempt (%d of %d)", j.ID, j.Attempt+1, j.MaxAttempts), "")
		case "completed":
			add(j.FinalizedAt, "done", fmt.Sprintf("job %d completed (attempt %d)", j.ID, j.Attempt), "")
		case "discarded", "cancelled":
			add(j.FinalizedAt, "dead", fmt.Sprintf("job %d %s (attempt %d of %d)", j.ID, j.State, j.Attempt, j.MaxAttempts), "")
		}
	}
	sort.SliceStable(ev, func(i, k int) bool { return ev[i].At.Before(ev[k].At) })
	return ev
}
