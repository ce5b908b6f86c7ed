package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/idemkit/idem"
	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
	"github.com/idemkit/idem/internal/sqlstate"
)

func init() { register(newCheckCmd) }

type checkConfig struct {
	minPremade int
	maxExpired int64
	maxStuck   int64
	stuckGrace time.Duration
	// riverSchema: where River's tables are, for the inbox's reconciliation.
	riverSchema string
}

// health is what check measured and what it concluded.
type health struct {
	MonthsAhead int   `json:"months_ahead"`
	DefaultRows int64 `json:"default_partition_rows"`
	Expired     int64 `json:"expired_rows"`
	Stuck       int64 `json:"stuck_leases"`
	// Lapsed: keys whose lease ended within the grace (idemctl stats
	// counts them as STUCK already; check waits for a redelivery first).
	Lapsed int64 `json:"lapsed_leases"`
	// Inbox: the inbox's reconciliation per source (when it is used).
	Inbox []inbox.SourceStats `json:"inbox,omitempty"`
	// StuckKeys names the oldest stuck keys (at most stuckNamed).
	StuckKeys []stuckKey `json:"stuck_keys,omitempty"`
	// DeadLetters names the inbox's dead letters, per source: not a fault
	// of the installation, but events an operator must look at (exit 7
	// when nothing else is wrong).
	DeadLetters []deadLetters `json:"dead_letters,omitempty"`
	// Failover: what the promotion of this server (a standby that became
	// the primary) left in flight, when it was promoted.
	Failover  *failoverLeft `json:"failover,omitempty"`
	Problems  []string      `json:"problems"`
	Attention []string      `json:"attention"`
}

// stuckKey is one key stuck in processing, and since when.
type stuckKey struct {
	Source     string    `json:"source"`
	Key        string    `json:"key"`
	LeaseEnded time.Time `json:"lease_ended"`
}

// deadLetters are one source's dead letters: how many, since when, and
// the first few keys.
type deadLetters struct {
	Source string    `json:"source"`
	Count  int64     `json:"count"`
	Oldest time.Time `json:"oldest"`
	Keys   []string  `json:"keys"`
}

// failoverLeft is what was in flight when this server was promoted: keys
// in processing whose lease was granted (or last extended) before the
// promotion, by a worker that may have done the work and lost its
// completion with the old primary (asynchronous replication), or may
// still complete it here.
type failoverLeft struct {
	PromotedAt time.Time     `json:"promoted_at"`
	Timeline   int64         `json:"timeline"`
	Processing int64         `json:"processing_from_before"`
	Keys       []inFlightKey `json:"keys,omitempty"`
}

// inFlightKey is one key a promotion left in flight, and its lease.
type inFlightKey struct {
	Source     string    `json:"source"`
	Key        string    `json:"key"`
	LeaseUntil time.Time `json:"lease_until"`
}

// stuckNamed and deadNamed: how many keys check names per problem.
const (
	stuckNamed = 5
	deadNamed  = 3
)

func newCheckCmd(a *app) *cobra.Command {
	cmd := &cobra.Command{Use: "check", Short: "health check: premade partitions, default-partition rows, expired backlog, stuck leases (exit 5 when unhealthy)", Args: cobra.ArbitraryArgs,
		Example: `  idemctl check
  idemctl check --max-expired 5000000 --stuck-grace 30m --json`}
	fs := cmd.Flags()
	var c checkConfig
	fs.IntVar(&c.minPremade, "min-premade", 2, "unhealthy when fewer months after the current one have a partition")
	fs.Int64Var(&c.maxExpired, "max-expired", 1_000_000, "unhealthy when more expired rows wait for prune")
	fs.Int64Var(&c.maxStuck, "max-stuck", 0, "unhealthy when more keys are stuck in processing")
	fs.DurationVar(&c.stuckGrace, "stuck-grace", 10*time.Minute, "a key is stuck when its lease ended this long ago and nobody re-acquired it")
	fs.StringVar(&c.riverSchema, "river-schema", "", "the schema of River's tables, for the inbox's reconciliation (default: the search_path)")
	asJSON := fs.Bool("json", false, "print JSON")
	cmd.RunE = func(_ *cobra.Command, args []string) error {
		ctx, io, g := a.ctx, a.io, &a.g
		_, _ = ctx, g
		if len(args) > 0 {
			return usageErr("check takes no arguments, got %q", args)
		}
		if c.minPremade < 0 || c.maxExpired < 0 || c.maxStuck < 0 || c.stuckGrace < 0 {
			return usageErr("check thresholds must not be negative")
		}
		if _, err := g.logger(io.Err); err != nil {
			return err
		}
		pool, err := g.connectMigrated(ctx, io.Env, 2)
		if err != nil {
			return err
		}
		defer pool.Close()
		h, err := measure(ctx, pool, c)
		if err != nil {
			return err
		}
		if *asJSON {
			enc := json.NewEncoder(io.Out)
			enc.SetIndent("", "  ")
			if err := enc.Encode(h); err != nil {
				return err
			}
		} else if len(h.Problems) == 0 {
			fmt.Fprintf(io.Out, "healthy: %d months premade, %s rows in the default partition, %s expired rows waiting, %s stuck leases (ended over %s ago)%s\n",
				h.MonthsAhead, human(h.DefaultRows), human(h.Expired), human(h.Stuck), c.stuckGrace, lapsedNote(h.Lapsed, c.stuckGrace))
		}
		if len(h.Problems) > 0 {
			return withCode(ExitUnhealthy, errors.New("unhealthy: "+strings.Join(append(h.Problems, h.Attention...), "; ")))
		}
		if len(h.Attention) > 0 {
			return withCode(ExitDeadLetters, errors.New("attention: "+strings.Join(h.Attention, "; ")))
		}
		return nil
	}
	return cmd
}

func measure(ctx context.Context, pool *pgxpool.Pool, c checkConfig) (*health, error) {
	q := pgxdb.New(pool)
	h := &health{Problems: []string{}, Attention: []string{}}
	hasCurrent, ahead, err := monthsAhead(ctx, q)
	if err != nil {
		return nil, err
	}
	h.MonthsAhead = ahead
	if h.DefaultRows, err = q.DefaultPartitionRows(ctx); err != nil {
		return nil, err
	}
	// Rows in the default partition stay there until prune deletes them
	// (claims find them there); a month with rows there gets no partition
	// meanwhile, so only a month rotation can make is a problem.
	if !hasCurrent {
		current, err := q.CurrentMonth(ctx)
		if err != nil {
			return nil, err
		}
		inDefault, err := q.MonthInDefault(ctx, current)
		if err != nil {
			return nil, err
		}
		if !inDefault {
			h.Problems = append(h.Problems, "the current month has no partition (claims go to the default partition): run `idemctl partitions rotate`")
		}
	}
	if h.MonthsAhead < c.minPremade {
		h.Problems = append(h.Problems, fmt.Sprintf("only %d months after this one have a partition, want %d: run `idemctl partitions rotate`", h.MonthsAhead, c.minPremade))
	}
	if h.Expired, err = q.PrunableRows(ctx); err != nil {
		return nil, err
	}
	if h.Expired > c.maxExpired {
		h.Problems = append(h.Problems, fmt.Sprintf("%d expired rows wait for prune (threshold %d): is `idemctl prune` scheduled?", h.Expired, c.maxExpired))
	}
	if h.Stuck, err = q.StuckLeases(ctx, c.stuckGrace.Milliseconds()); err != nil {
		return nil, err
	}
	detached, err := q.DetachedMonths(ctx)
	if err != nil {
		return nil, err
	}
	var pending []string
	for _, d := range detached {
		if d.DropPending {
			pending = append(pending, d.Name)
		}
	}
	if len(pending) > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("%s detached by a rotation whose DROP did not happen (a lock it gave up on, or a stop between the two): %s; the next `idemctl partitions rotate` drops %s",
			plural(int64(len(pending)), "month", "months"), strings.Join(pending, ", "), map[bool]string{true: "it", false: "them"}[len(pending) == 1]))
	}
	if h.Lapsed, err = q.LapsedLeases(ctx, c.stuckGrace.Milliseconds()); err != nil {
		return nil, err
	}
	if h.Stuck > c.maxStuck {
		if h.StuckKeys, err = stuckKeys(ctx, pool, c.stuckGrace); err != nil {
			return nil, err
		}
		h.Problems = append(h.Problems, fmt.Sprintf("%s stuck in processing more than %s past %s lease (threshold %d): %s: workers died and no redelivery came; "+
			"`idemctl release --source S --key K` lets the next delivery run one again",
			plural(h.Stuck, "key", "keys"), c.stuckGrace, map[bool]string{true: "its", false: "their"}[h.Stuck == 1], c.maxStuck, nameStuck(h.StuckKeys, h.Stuck)))
	}
	if h.Failover, err = failoverLeftovers(ctx, pool); err != nil {
		return nil, err
	}
	if f := h.Failover; f != nil && f.Processing > 0 {
		h.Attention = append(h.Attention, fmt.Sprintf("%s in processing since before this server's promotion at %s (timeline %d): %s; "+
			"a worker may have done the work and lost its completion with the old primary: each runs again at its next delivery after its lease, and its effects replay or send their outbound keys again",
			plural(f.Processing, "key", "keys"), f.PromotedAt.UTC().Format(time.DateTime+"Z"), f.Timeline, nameInFlight(f.Keys, f.Processing)))
	}
	// Every event the inbox accepted is processed, dead-lettered, or
	// queued with a job that will run it.
	ib, err := inbox.Reconcile(ctx, pool, c.riverSchema)
	h.Inbox = ib
	if err != nil && len(ib) > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("the inbox's jobs cannot be read: %v", err))
	}
	for _, s := range ib {
		switch {
		case !s.Balanced():
			h.Problems = append(h.Problems, fmt.Sprintf("inbox %s: %d accepted events are unaccounted for (%s)", s.Source, s.Accepted-s.Processed-s.Dead-s.Queued, s))
		case s.Unaccounted > 0:
			h.Problems = append(h.Problems, fmt.Sprintf("inbox %s: %d accepted events have no job that will run them: a worker client repairs them (inbox.Repair), or replay after it dead-letters them", s.Source, s.Unaccounted))
		}
		if s.Crashing > 0 {
			keys := make([]string, len(s.CrashingKeys))
			for i, k := range s.CrashingKeys {
				keys[i] = idem.Quote(k)
			}
			if more := s.Crashing - int64(len(keys)); more > 0 {
				keys = append(keys, fmt.Sprintf("and %s more", human(more)))
			}
			h.Problems = append(h.Problems, fmt.Sprintf("inbox %s: %s crashed or hung %s worker mid-attempt (River rescued %s job) and will run again (%s): its handler may kill its process; it is dead-lettered once its attempts run out",
				s.Source, plural(s.Crashing, "event", "events"), map[bool]string{true: "its", false: "their"}[s.Crashing == 1],
				map[bool]string{true: "its", false: "their"}[s.Crashing == 1], strings.Join(keys, ", ")))
		}
	}
	if err == nil {
		if err := deadLetterAttention(ctx, pool, c.riverSchema, ib, h); err != nil {
			h.Problems = append(h.Problems, fmt.Sprintf("the inbox's dead letters cannot be read: %v", err))
		}
	}
	// Who may do what: a role that is both, CREATE on schema idem for
	// others, a table posing as a month, a half-made month.
	audit, err := q.Audit(ctx)
	if err != nil {
		return nil, err
	}
	for _, a := range audit {
		h.Problems = append(h.Problems, a.Problem+": "+a.Fix)
	}
	public, err := q.PublicRoutines(ctx)
	if err != nil {
		return nil, err
	}
	if len(public) > 0 {
		h.Problems = append(h.Problems, fmt.Sprintf("PUBLIC may execute %d routines of schema idem (%s): run `idemctl migrate up`, or REVOKE ALL ON ALL ROUTINES IN SCHEMA idem FROM PUBLIC",
			len(public), strings.Join(public, ", ")))
	}
	return h, nil
}

// monthsAhead reports whether the current month (by the database's clock)
// has a partition, and how many consecutive months after it have one.
func monthsAhead(ctx context.Context, q *pgxdb.Queries) (hasCurrent bool, ahead int, err error) {
	parts, err := q.PartitionMonths(ctx) // every scrape of /metrics: no row counts
	if err != nil {
		return false, 0, err
	}
	now, err := q.CurrentMonth(ctx)
	if err != nil {
		return false, 0, err
	}
	have := map[string]bool{}
	for _, p := range parts {
		if p.MonthFrom.Valid {
			have[p.MonthFrom.Time.Format("2006-01")] = true
		}
	}
	for m := now.Time.AddDate(0, 1, 0); have[m.Format("2006-01")]; m = m.AddDate(0, 1, 0) {
		ahead++
	}
	return have[now.Time.Format("2006-01")], ahead, nil
}

// stuckKeys are the stuckNamed keys whose lease ended longest ago.
func stuckKeys(ctx context.Context, pool *pgxpool.Pool, grace time.Duration) ([]stuckKey, error) {
	rows, err := pool.Query(ctx, `SELECT e.source, e.key, e.lease_expires_at
	  FROM idem.processed_events e
	 WHERE e.status = 'processing'
	   AND e.lease_expires_at < idem.clock() - $1::bigint::double precision * interval '1 millisecond'
	   AND e.expires_at > idem.clock()
	 ORDER BY e.lease_expires_at, e.source, e.key
	 LIMIT $2`, grace.Milliseconds(), stuckNamed)
	if err != nil {
		return nil, fmt.Errorf("name the stuck keys: %w", err)
	}
	keys, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (stuckKey, error) {
		var k stuckKey
		err := r.Scan(&k.Source, &k.Key, &k.LeaseEnded)
		return k, err
	})
	if err != nil {
		return nil, fmt.Errorf("name the stuck keys: %w", err)
	}
	return keys, nil
}

// failoverLeftovers finds this server's promotion, nil when it never
// was promoted (timeline 1) or the role may not list pg_wal (pg_ls_waldir:
// superuser or pg_monitor). A promotion writes the history file of its
// new timeline, the highest-numbered one, into pg_wal; its modification
// time is the promotion's, to the second (pg_ls_waldir reports whole
// seconds). Then it counts the keys in processing whose lease was granted
// or extended before the end of that second, not held for the inbox's queue
// (a queued event waits for its job, whatever the promotion), and names
// the oldest.
func failoverLeftovers(ctx context.Context, pool *pgxpool.Pool) (*failoverLeft, error) {
	var name string
	var f failoverLeft
	err := pool.QueryRow(ctx, `SELECT w.name, w.modification FROM pg_catalog.pg_ls_waldir() w
		WHERE w.name OPERATOR(pg_catalog.~) '^[0-9A-F]{8}\.history$' ORDER BY w.name DESC LIMIT 1`).Scan(&name, &f.PromotedAt)
	switch {
	case errors.Is(err, pgx.ErrNoRows), sqlstate.Of(err) == sqlstate.InsufficientPrivilege:
		return nil, nil
	case err != nil:
		return nil, fmt.Errorf("look for a promotion: %w", err)
	}
	if _, err := fmt.Sscanf(name, "%08X.history", &f.Timeline); err != nil {
		return nil, fmt.Errorf("look for a promotion: history file %q: %w", name, err)
	}
	// The file's time is truncated to the second: a key claimed in the
	// same second just before the promotion is still from before it. A
	// key claimed within that second just after it is named too: the
	// check errs towards attention, never towards silence.
	cutoff := f.PromotedAt.Add(time.Second)
	const from = ` FROM idem.processed_events e
	 WHERE e.status = 'processing' AND e.updated_at < $1 AND e.expires_at > idem.clock()
	   AND NOT EXISTS (SELECT FROM idem.holds h WHERE h.source = e.source AND h.key = e.key)`
	if err := pool.QueryRow(ctx, `SELECT count(*)`+from, cutoff).Scan(&f.Processing); err != nil {
		return nil, fmt.Errorf("count the keys in flight at the promotion: %w", err)
	}
	rows, err := pool.Query(ctx, `SELECT e.source, e.key, e.lease_expires_at`+from+` ORDER BY e.updated_at, e.source, e.key LIMIT $2`, cutoff, stuckNamed)
	if err != nil {
		return nil, fmt.Errorf("name the keys in flight at the promotion: %w", err)
	}
	if f.Keys, err = pgx.CollectRows(rows, func(r pgx.CollectableRow) (inFlightKey, error) {
		var k inFlightKey
		err := r.Scan(&k.Source, &k.Key, &k.LeaseUntil)
		return k, err
	}); err != nil {
		return nil, fmt.Errorf("name the keys in flight at the promotion: %w", err)
	}
	return &f, nil
}

// nameInFlight is "s/k (lease until T), ..., and N more".
func nameInFlight(keys []inFlightKey, total int64) string {
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s/%s (lease until %s)", k.Source, idem.Quote(k.Key), k.LeaseUntil.UTC().Format(time.DateTime+"Z")))
	}
	if more := total - int64(len(keys)); more > 0 {
		parts = append(parts, fmt.Sprintf("and %s more", human(more)))
	}
	return strings.Join(parts, ", ")
}

// nameStuck is "s/k (lease ended T), ..., and N more".
func nameStuck(keys []stuckKey, total int64) string {
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s/%s (lease ended %s)", k.Source, idem.Quote(k.Key), k.LeaseEnded.UTC().Format(time.DateTime+"Z")))
	}
	if more := total - int64(len(keys)); more > 0 {
		parts = append(parts, fmt.Sprintf("and %s more", human(more)))
	}
	return strings.Join(parts, ", ")
}

// deadLetterAttention names each source's dead letters in h.
func deadLetterAttention(ctx context.Context, pool *pgxpool.Pool, riverSchema string, ib []inbox.SourceStats, h *health) error {
	var in *inbox.Inbox
	for _, s := range ib {
		if s.Dead <= 0 {
			continue
		}
		if in == nil {
			var err error
			if in, err = inbox.New(inbox.Config{Pool: pool, Schema: riverSchema}); err != nil {
				return err
			}
		}
		// The oldest deadNamed: the first is the oldest.
		dead, err := in.DeadLetters(ctx, inbox.Filter{Source: s.Source, Limit: deadNamed})
		if err != nil {
			return err
		}
		d := deadLetters{Source: s.Source, Count: s.Dead, Keys: []string{}}
		for i, l := range dead {
			if i < deadNamed {
				d.Keys = append(d.Keys, l.Key)
			}
			if d.Oldest.IsZero() || l.FailedAt.Before(d.Oldest) {
				d.Oldest = l.FailedAt
			}
		}
		h.DeadLetters = append(h.DeadLetters, d)
		keys := make([]string, len(d.Keys))
		for i, k := range d.Keys {
			keys[i] = idem.Quote(k)
		}
		if more := d.Count - int64(len(keys)); more > 0 {
			keys = append(keys, fmt.Sprintf("and %s more", human(more)))
		}
		since := ""
		if !d.Oldest.IsZero() {
			since = ", the oldest since " + d.Oldest.UTC().Format(time.DateTime+"Z")
		}
		h.Attention = append(h.Attention, fmt.Sprintf("inbox %s: %s%s (%s): `idemctl inbox list --source %s` shows why, `idemctl inbox replay --source %s` runs them again",
			s.Source, plural(d.Count, "dead letter", "dead letters"), since, strings.Join(keys, ", "), shellQuote(s.Source), shellQuote(s.Source)))
	}
	return nil
}

// plural is "1 key", "2 keys", with separators.
func plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return human(n) + " " + many
}

// lapsedNote says how many leases ended within the grace: idemctl stats
// counts them as stuck, check not yet (a redelivery may still take them).
func lapsedNote(n int64, grace time.Duration) string {
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("; %s ended less than %s ago, stuck if no redelivery takes %s by then",
		plural(n, "lease", "leases"), grace, map[bool]string{true: "it", false: "them"}[n == 1])
}
