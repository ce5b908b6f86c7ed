package migrate_test

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func waitKey(source, key string) string {
	sum := md5.Sum([]byte(source + "\x1f" + key))
	return hex.EncodeToString(sum[:])
}

// TestUpgradeTo8: from version 7 holding data (completed keys, a key in
// progress, an application and a maintainer role granted at 7), the
// upgrade to 8 keeps every answer, gives the application role the wait
// functions and the maintainer release, and a waiter registered
// for the key in progress is notified when it completes, through a
// partition made before the upgrade. Down to 7 removes version 8's objects
// and keeps the answers; up again works.
func TestUpgradeTo8(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 7); err != nil {
		t.Fatal(err)
	}
	app, maint := appAndMaintainer(t, db, "idem_up8")
	seedCompleted(t, db)
	var token int64
	if err := db.QueryRowContext(ctx, `SELECT token FROM idem.claim('up', 'running', lease => '1 hour')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	completedAnswered(t, db, "after the upgrade to 8")
	var rights bool
	if err := db.QueryRowContext(ctx, `SELECT has_function_privilege($1, 'idem.wait_begin(text, text, interval)', 'EXECUTE')
		AND has_function_privilege($1, 'idem.wait_end(bigint)', 'EXECUTE')
		AND has_function_privilege($1, 'idem.peek(text, text)', 'EXECUTE')
		AND NOT has_table_privilege($1, 'idem.waiters', 'SELECT')
		AND NOT has_function_privilege($1, 'idem.release(text, text)', 'EXECUTE')
		AND has_function_privilege($2, 'idem.release(text, text)', 'EXECUTE')`, app, maint).Scan(&rights); err != nil || !rights {
		t.Fatalf("the application role's rights after the upgrade: %v %v", rights, err)
	}

	// As the application role: wait for the key in progress, be notified
	// when it completes (completed by that role too: the trigger runs with
	// complete's rights, not the role's).
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	for _, q := range []string{`SET ROLE ` + app, `LISTEN idem_done`} {
		if _, err := conn.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	var status string
	var id int64
	if err := conn.QueryRow(ctx, `SELECT status FROM idem.peek('up', 'running')`).Scan(&status); err != nil || status != "processing" {
		t.Fatalf("peek: %q %v", status, err)
	}
	if err := conn.QueryRow(ctx, `SELECT idem.wait_begin('up', 'running', '1 minute')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	var outcome string
	if err := conn.QueryRow(ctx, `SELECT idem.complete('up', 'running', $1, '{"v": 2}')`, token).Scan(&outcome); err != nil || outcome != "completed" {
		t.Fatalf("complete: %s %v", outcome, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if n, err := conn.WaitForNotification(wctx); err != nil || n.Payload != waitKey("up", "running") {
		t.Fatalf("notification: %+v %v", n, err)
	}
	if _, err := conn.Exec(ctx, `SELECT idem.wait_end($1)`, id); err != nil {
		t.Fatal(err)
	}

	if _, err := p.DownTo(ctx, 7); err != nil {
		t.Fatal(err)
	}
	completedAnswered(t, db, "down to 7")
	var gone bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass('idem.waiters') IS NULL AND to_regprocedure('idem.peek(text, text)') IS NULL
		AND NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgname = 'processed_events_done')`).Scan(&gone); err != nil || !gone {
		t.Fatalf("version 8's objects left after down: %v", err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	completedAnswered(t, db, "up to 8 again")
}
