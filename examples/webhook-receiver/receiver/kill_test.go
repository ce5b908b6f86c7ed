package receiver_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/webhook-receiver/receiver"
	"github.com/idemkit/idem/internal/testdb"
)

const childEnv = "RECEIVER_TEST_CHILD"

// child is the receiver as a process of its own: the test kills it with
// SIGKILL in the middle of a delivery. Its database sessions live at the
// time in CHILD_CLOCK (idem's test clock), so a later child sees the
// leases of a killed one lapsed.
func child() int {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(os.Getenv("CHILD_DATABASE_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cfg.ConnConfig.RuntimeParams[testdb.ClockParam] = os.Getenv("CHILD_CLOCK")
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	api, err := receiver.NewAPI(os.Getenv("CHILD_STUB_URL"), os.Getenv("CHILD_STUB_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	c, err := idem.New(pool, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	rc := &receiver.Receiver{Pool: pool, Idem: c, API: api}
	h, err := rc.Handler(slog.New(slog.NewTextHandler(os.Stderr, nil)), secret)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Println("listening", ln.Addr())
	return func() int { _ = http.Serve(ln, h); return 1 }()
}

// proc is a running child.
type proc struct {
	cmd    *exec.Cmd
	url    string
	stderr *testdb.Buffer
	once   sync.Once
}

func startChild(t *testing.T, w *world, stubURL string, clock time.Time) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=1", "CHILD_DATABASE_URL="+w.url, "CHILD_STUB_URL="+stubURL,
		"CHILD_CLOCK="+clock.UTC().Format(time.RFC3339Nano))
	p := &proc{cmd: cmd, stderr: &testdb.Buffer{}}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.kill)
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		p.kill()
		t.Fatalf("child did not start: %v\n%s", err, p.stderr)
	}
	go io.Copy(io.Discard, out)
	p.url = "http://" + strings.TrimSpace(strings.TrimPrefix(line, "listening "))
	return p
}

// kill sends SIGKILL and reaps the process.
func (p *proc) kill() {
	p.once.Do(func() {
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
		_ = p.cmd.Wait()
	})
}

// TestKilledAtEachStep: the receiver's process is killed with SIGKILL (or
// the step fails) at each step of the invoice.paid handler; the event is
// then redelivered by 8 racing senders and 3 more times, to a new process.
// Every time: one payment row, one fee charged at the provider, which saw
// the same Idempotency-Key on every attempt, and one receipt sent.
func TestKilledAtEachStep(t *testing.T) {
	ctx := context.Background()
	w := newWorld(t)
	if _, err := w.pool.Exec(ctx, `
		CREATE TABLE faults (invoice text PRIMARY KEY);
		CREATE FUNCTION fail_booking() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF EXISTS (SELECT 1 FROM faults WHERE invoice = NEW.invoice_id) THEN
				RAISE EXCEPTION 'injected: could not extend file: No space left on device';
			END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER payments_fail BEFORE INSERT ON payments FOR EACH ROW EXECUTE FUNCTION fail_booking()`); err != nil {
		t.Fatal(err)
	}

	base := time.Now()
	gen := 0
	var cur *proc
	restart := func() {
		gen++ // an hour later each time: every lease of the killed process has lapsed
		cur = startChild(t, w, w.stubURL, base.Add(time.Duration(gen)*time.Hour))
	}
	restart()

	type fault struct {
		path     string // the provider endpoint the fault fires at
		done     bool   // after the provider acted (true) or before (false)
		kill     bool   // SIGKILL the receiver (else the provider answers 5xx)
		complete bool   // kill while the receiver records the event as done
		booking  bool   // the payment's INSERT fails
	}
	// writes: the requests the provider gets for the fee and the email.
	// Above 1, the same key came again and was answered from the
	// provider's record of it; 1 after a failure past an effect means the
	// re-run replayed that effect from idem without calling at all.
	cases := []struct {
		name   string
		f      fault
		writes [2]int
	}{
		{"booking fails", fault{booking: true}, [2]int{1, 1}},
		{"killed before the provider charges", fault{path: "/v1/charges", kill: true}, [2]int{2, 1}},
		{"killed after the provider charged (answer lost)", fault{path: "/v1/charges", done: true, kill: true}, [2]int{2, 1}},
		{"provider charged, the answer fails on the way", fault{path: "/v1/charges", done: true}, [2]int{2, 1}},
		{"killed before the mail API sends", fault{path: "/v1/emails", kill: true}, [2]int{1, 2}},
		{"killed after the mail API sent (answer lost)", fault{path: "/v1/emails", done: true, kill: true}, [2]int{1, 2}},
		{"mail API down", fault{path: "/v1/emails"}, [2]int{1, 2}},
		{"killed before the event is recorded as done", fault{path: "/v1/emails", done: true, complete: true}, [2]int{1, 1}},
	}
	var (
		mu     sync.Mutex
		armed  fault
		target string
		fired  = make(chan struct{}, 1)
	)
	w.stub.Hook = func(path, key, invoice string, done bool) error {
		mu.Lock()
		f := armed
		match := invoice == target && path == f.path && done == f.done
		if match {
			target = "" // once
		}
		mu.Unlock()
		if !match {
			return nil
		}
		defer func() { fired <- struct{}{} }()
		switch {
		case f.complete:
			holdEventThenKill(t, w, cur, invoice, fired)
			return nil
		case f.kill:
			cur.kill()
			return errors.New("the caller was killed")
		}
		return errors.New("injected: 502 from the proxy")
	}

	for i, tc := range cases {
		n := 100 + i
		inv := fmt.Sprintf("in_%d", n)
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			armed, target = tc.f, inv
			mu.Unlock()
			if tc.f.booking {
				if _, err := w.pool.Exec(ctx, `INSERT INTO faults VALUES ($1)`, inv); err != nil {
					t.Fatal(err)
				}
			}
			body := invoicePaid(n)
			resp, err := deliver(cur.url, body, secret, time.Now())
			first := "error: " + fmt.Sprint(err)
			if err == nil {
				resp.Body.Close()
				first = resp.Status
			}
			switch {
			case tc.f.booking:
				if _, err := w.pool.Exec(ctx, `DELETE FROM faults`); err != nil {
					t.Fatal(err)
				}
			default:
				select {
				case <-fired:
				case <-time.After(20 * time.Second):
					t.Fatalf("the fault never fired (first delivery: %s)\n%s", first, cur.stderr)
				}
				if tc.f.complete {
					<-fired // the kill itself
				}
			}
			if err == nil && resp.StatusCode == 200 {
				t.Fatalf("the first delivery succeeded despite the fault")
			}
			if tc.f.kill || tc.f.complete {
				restart()
			}

			// Redelivered: 8 senders at once, then 3 more times.
			var wg sync.WaitGroup
			for range 8 {
				wg.Add(1)
				go func() { defer wg.Done(); redeliver(t, cur.url, body) }()
			}
			wg.Wait()
			for range 3 {
				redeliver(t, cur.url, body)
			}

			fees, mails := w.stub.Done("/v1/charges", inv), w.stub.Done("/v1/emails", inv)
			if len(fees) != 1 || len(mails) != 1 {
				t.Fatalf("fees %v, emails %v: want one of each", fees, mails)
			}
			for i, path := range []string{"/v1/charges", "/v1/emails"} {
				writes := w.stub.Writes(path, inv)
				if len(writes) != tc.writes[i] {
					t.Errorf("%s got %d requests, want %d", path, len(writes), tc.writes[i])
				}
				for _, wr := range writes {
					if wr.Key != writes[0].Key {
						t.Fatalf("%s saw keys %v: want the same on every attempt", path, writes)
					}
				}
			}
			var payments int
			var status string
			if err := w.pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM payments WHERE invoice_id = $1),
				(SELECT status FROM idem.processed_events WHERE source = 'stripe' AND key = $2)`, inv, fmt.Sprintf("evt_%d", n)).Scan(&payments, &status); err != nil {
				t.Fatal(err)
			}
			if payments != 1 || status != "completed" {
				t.Fatalf("payments %d, event %s", payments, status)
			}
			t.Logf("first delivery: %s; provider requests: %d fee, %d email; one charge, one email",
				first, len(w.stub.Writes("/v1/charges", inv)), len(w.stub.Writes("/v1/emails", inv)))
		})
	}
	if t.Failed() {
		t.Logf("last child's log:\n%s", cur.stderr)
	}
}

// redeliver is Stripe retrying until a 2xx.
func redeliver(t *testing.T, url string, body []byte) {
	for attempt := 1; attempt <= 20; attempt++ {
		resp, err := deliver(url, body, secret, time.Now())
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		time.Sleep(time.Duration(attempt) * 20 * time.Millisecond)
	}
	t.Error("redelivery never succeeded")
}

// holdEventThenKill locks the event's row, so that the receiver blocks
// when it records the event as done (every effect has run by then); once it
// does, it kills the receiver and terminates its blocked session (what the
// server does when it notices the client is gone), so the event stays
// processing. The row is locked before the provider answers.
func holdEventThenKill(t *testing.T, w *world, p *proc, invoice string, fired chan<- struct{}) {
	ctx := context.Background()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		t.Error(err)
		return
	}
	key := "evt_" + strings.TrimPrefix(invoice, "in_")
	if _, err := tx.Exec(ctx, `SELECT 1 FROM idem.processed_events WHERE source = 'stripe' AND key = $1 FOR UPDATE`, key); err != nil {
		t.Error(err)
		return
	}
	go func() {
		defer func() { fired <- struct{}{} }()
		defer tx.Rollback(ctx)
		for range 400 {
			var pid int
			err := w.pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%idem.complete%'`).Scan(&pid)
			if err == nil {
				p.kill()
				if _, err := w.pool.Exec(ctx, `SELECT pg_terminate_backend($1, 5000)`, pid); err != nil {
					t.Error(err)
				}
				return
			}
			time.Sleep(25 * time.Millisecond)
		}
		t.Error("the receiver never got to record the event")
	}()
}
