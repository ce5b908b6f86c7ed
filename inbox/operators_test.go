package inbox_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river/rivertype"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/inbox"
)

// deadLetters accepts n events of source whose handler fails for good,
// runs them and returns once all n are dead letters. The application's
// Inbox allows the source 3 attempts.
func deadLetters(t *testing.T, pool *pgxpool.Pool, source string, n int, payload []byte) *inbox.Inbox {
	t.Helper()
	ctx := context.Background()
	app, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{}, MaxAttempts: map[string]int{source: 3},
		Handler: func(context.Context, pgx.Tx, *inbox.Delivery) (any, error) {
			return nil, idem.Permanent(errors.New("unknown customer"))
		}})
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if _, err := app.Accept(ctx, &inbox.Delivery{Source: source, Key: fmt.Sprintf("evt_%d", i), EventType: "charge", Payload: payload}); err != nil {
			t.Fatal(err)
		}
	}
	rc := start(t, app, 4, nil)
	waitFor(t, "the dead letters", func() bool {
		d, err := app.DeadLetters(ctx, inbox.Filter{Source: source})
		return err == nil && len(d) == n && d[n-1].State == rivertype.JobStateCancelled
	})
	if err := rc.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	return app
}

// TestOperatorsReplay: dead letters replayed from operators' tools (an
// Inbox with no handler and no MaxAttempts, as idemctl and the dashboard
// build one), by two operators at once: every event is replayed once,
// none is reported "payload lost", and each new job allows the 3 attempts
// the application configured, not the default 10.
func TestOperatorsReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	const n = 20
	deadLetters(t, pool, "billing", n, []byte(`{"customer":"cus_x"}`))
	var wg sync.WaitGroup
	results := make([][]inbox.ReplayResult, 2)
	for i := range results {
		tool, err := inbox.New(inbox.Config{Pool: pool})
		if err != nil {
			t.Fatal(err)
		}
		wg.Go(func() {
			var err error
			if results[i], err = tool.Replay(ctx, inbox.Filter{Source: "billing"}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	replayed := map[string]int64{}
	for _, rs := range results {
		for _, r := range rs {
			switch r.Outcome {
			case "replayed":
				if _, twice := replayed[r.Key]; twice {
					t.Errorf("%s replayed twice", r.Key)
				}
				replayed[r.Key] = r.NewJobID
			case "in progress":
			default:
				t.Errorf("%s: %s %s", r.Key, r.Outcome, r.Error)
			}
		}
	}
	if len(replayed) != n {
		t.Fatalf("%d events replayed, want %d", len(replayed), n)
	}
	for key, id := range replayed {
		if m := count(t, pool, `SELECT max_attempts FROM river_job WHERE id = $1`, id); m != 3 {
			t.Fatalf("%s: the replayed job allows %d attempts, want the application's 3", key, m)
		}
	}
}

// countingConn counts the bytes a connection reads.
type countingConn struct {
	net.Conn
	n *atomic.Int64
}

func (c countingConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.n.Add(int64(n))
	return n, err
}

// TestDeadLettersReadNoPayload: listing 30 dead letters of 512 KiB each
// (what the dashboard's page and idemctl inbox list do) reads none of
// their payloads: well under one payload's size crosses the wire.
func TestDeadLettersReadNoPayload(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, pool := setup(t)
	payload := []byte(`{"blob":"` + strings.Repeat("x", 512<<10) + `"}`)
	deadLetters(t, pool, "big", 30, payload)
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	var read atomic.Int64
	d := &net.Dialer{}
	cfg.ConnConfig.DialFunc = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := d.DialContext(ctx, network, addr)
		return countingConn{c, &read}, err
	}
	counted, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer counted.Close()
	tool, err := inbox.New(inbox.Config{Pool: counted})
	if err != nil {
		t.Fatal(err)
	}
	if err := counted.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	before := read.Load()
	dead, err := tool.DeadLetters(ctx, inbox.Filter{})
	if err != nil || len(dead) != 30 || dead[0].EventType != "charge" || dead[0].Attempts != 1 {
		t.Fatalf("%d dead letters %v: %+v", len(dead), err, dead)
	}
	if got := read.Load() - before; got > 64<<10 {
		t.Fatalf("listing read %d bytes: the payloads (30 x 512 KiB) were read", got)
	}
}

// TestReplayRacesAnotherReplay: a replay lists a dead letter, and another
// operator's replay of it commits before the first reads its job (forced
// here: the job table is locked while the other replay's effect, a new job
// for the hold and the dead job gone, is written). The first replay does
// not report "payload lost": the event is no longer a dead letter.
func TestReplayRacesAnotherReplay(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	deadLetters(t, pool, "race", 1, []byte(`{"customer":"cus_x"}`))
	var job int64
	if err := pool.QueryRow(ctx, `SELECT job_id FROM idem.holds WHERE source = 'race'`).Scan(&job); err != nil {
		t.Fatal(err)
	}
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(ctx)
	for _, q := range []string{`LOCK TABLE river_job IN ACCESS EXCLUSIVE MODE`,
		`UPDATE idem.holds SET state = 'queued', job_id = job_id + 1000, dead_at = NULL WHERE source = 'race'`,
		`DELETE FROM river_job WHERE id = ` + fmt.Sprint(job)} {
		if _, err := other.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	tool, err := inbox.New(inbox.Config{Pool: pool})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan []inbox.ReplayResult, 1)
	go func() {
		res, err := tool.Replay(ctx, inbox.Filter{Source: "race"})
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	// The replay has listed the dead letter and waits for the job table.
	waitFor(t, "the replay to wait for the job table", func() bool {
		return count(t, pool, `SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'river_job'::regclass`) > 0
	})
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, r := range <-done {
		if r.Outcome == "payload lost" {
			t.Fatalf("%s reported %q after another replay took it: %s", r.Key, r.Outcome, r.Error)
		}
	}
}

// TestDeadLetterPayloadOutlivesItsJob: an application's own River client
// keeps River's default retention of discarded and cancelled jobs (7
// days) and deletes a dead letter's job with its payload. The payload
// kept on the hold (migration 17) survives it: the dead letter is listed
// with its event type, not as "payload lost", and replay runs the
// handler with the original payload, target and attempts.
func TestDeadLetterPayloadOutlivesItsJob(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := setup(t)
	const n = 3
	payload := []byte(`{"customer":"cus_kept","note":"é\u2028"}`)
	deadLetters(t, pool, "kept", n, payload)
	// What River's job cleaner does past DiscardedJobRetentionPeriod /
	// CancelledJobRetentionPeriod: delete the finalized jobs.
	if _, err := pool.Exec(ctx, `DELETE FROM river_job WHERE state IN ('discarded', 'cancelled')`); err != nil {
		t.Fatal(err)
	}
	var got sync.Map
	app, err := inbox.New(inbox.Config{Pool: pool, RetryPolicy: fast{},
		Handler: func(ctx context.Context, tx pgx.Tx, d *inbox.Delivery) (any, error) {
			if _, dup := got.LoadOrStore(d.Key, string(d.Payload)); dup {
				t.Errorf("%s handled twice", d.Key)
			}
			return nil, record(ctx, tx, d)
		}})
	if err != nil {
		t.Fatal(err)
	}
	dead, err := app.DeadLetters(ctx, inbox.Filter{Source: "kept"})
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != n {
		t.Fatalf("%d dead letters, want %d", len(dead), n)
	}
	for _, d := range dead {
		if d.PayloadLost || d.State != "" || d.EventType != "charge" || d.AcceptedAt.IsZero() {
			t.Errorf("%s: listed %+v, want its job gone, its payload kept, its event type and acceptance time", d.Key, d)
		}
	}
	rs, err := app.Replay(ctx, inbox.Filter{Source: "kept"})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rs {
		if r.Outcome != "replayed" {
			t.Errorf("%s: %s %s, want replayed", r.Key, r.Outcome, r.Error)
		}
	}
	start(t, app, 2, nil)
	waitFor(t, "the replayed events", func() bool {
		return count(t, pool, `SELECT count(*) FROM processed WHERE source = 'kept'`) == n
	})
	got.Range(func(k, v any) bool {
		if v.(string) != string(payload) {
			t.Errorf("%s: handler got payload %q, want %q", k, v, payload)
		}
		return true
	})
	if m := count(t, pool, `SELECT count(*) FROM idem.holds WHERE source = 'kept'`); m != 0 {
		t.Errorf("%d holds left after the replays completed, want 0 (the kept payloads go with them)", m)
	}
}
