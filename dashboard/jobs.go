package dashboard

import (
	"net/http"

	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem/inbox"
)

// jobsPage is how many jobs a state's list shows; jobsCount how far each
// state is counted.
const (
	jobsPage  = 50
	jobsCount = 10000
)

// jobState is one state's section of the jobs page.
type jobState struct {
	State rivertype.JobState
	Title string
	Note  string
	Count int64 // up to jobsCount+1
	Jobs  []inbox.JobInfo
}

type jobsView struct {
	Inbox  bool
	States []jobState
	Cap    int64
}

// jobSections are the jobs page's sections, in the order a job goes
// through them.
var jobSections = []struct {
	state       rivertype.JobState
	title, note string
}{
	{rivertype.JobStateRunning, "Running", "since its attempt started, which attempt of how many"},
	{rivertype.JobStateRetryable, "Retrying", "its next attempt, and the error of the last"},
	{rivertype.JobStateAvailable, "Queued", "waiting for a worker"},
	{rivertype.JobStateScheduled, "Scheduled", "waiting for its time"},
	{rivertype.JobStateCancelled, "Dead: a permanent error", "cancelled at once (idem.Permanent): the dead letters page replays them"},
	{rivertype.JobStateDiscarded, "Dead: out of attempts", "discarded after the last attempt: the dead letters page replays them"},
	{rivertype.JobStateCompleted, "Completed", "the latest first (River keeps them for a day by default)"},
}

// jobs is the inbox's jobs by state: a replay's new jobs are marked, and
// with the live script the page shows them move from queued to running to
// completed.
func (d *Dashboard) jobs(w http.ResponseWriter, r *http.Request) {
	p, cancel, ok := d.page(w, r)
	defer cancel()
	if !ok {
		return
	}
	v := jobsView{Inbox: d.cfg.Inbox != nil, Cap: jobsCount}
	if d.cfg.Inbox != nil {
		counts, err := d.cfg.Inbox.JobCounts(p.ctx, jobsCount)
		if err != nil {
			d.fail(w, r, "jobs", err)
			return
		}
		for _, s := range jobSections {
			js := jobState{State: s.state, Title: s.title, Note: s.note, Count: counts[s.state]}
			if js.Count > 0 {
				if js.Jobs, err = d.cfg.Inbox.Jobs(p.ctx, s.state, jobsPage); err != nil {
					d.fail(w, r, "jobs", err)
					return
				}
			}
			v.States = append(v.States, js)
		}
	}
	d.renderLive(w, r, http.StatusOK, "jobs", "jobs", "Inbox jobs", p.now, v)
}
