package migrate_test

import (
	"context"
	"database/sql"
	"testing"
)

// TestUpgradeTo12: from version 11 holding data with app and maintainer
// roles granted at 11 (who may not ask idem.distributed() there), the
// upgrade to 12 keeps every answer and lets both roles ask it, as it lets
// roles granted after the upgrade; down to 11 takes it back from them;
// up again gives it back.
func TestUpgradeTo12(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 11); err != nil {
		t.Fatal(err)
	}
	app, maint := appAndMaintainer(t, db, "idem_up12")
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	for _, r := range []string{app, maint} {
		if asks := mayAskDistributed(t, db, r); asks {
			t.Fatalf("%s may ask idem.distributed() at 11: the test would prove nothing", r)
		}
	}

	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 12")
	_, app2 := appAndMaintainer(t, db, "idem_up12_after")
	if _, err := db.ExecContext(ctx, `SELECT idem.grant_app('`+app2+`')`); err != nil {
		t.Fatal(err)
	}
	for _, r := range []string{app, maint, app2} {
		if !mayAskDistributed(t, db, r) {
			t.Fatalf("%s may not ask idem.distributed() at 12", r)
		}
	}

	if _, err := p.DownTo(ctx, 11); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 11")
	for _, r := range []string{app, maint, app2} {
		if mayAskDistributed(t, db, r) {
			t.Fatalf("%s may still ask idem.distributed() after down to 11", r)
		}
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 12 again")
	for _, r := range []string{app, maint} {
		if !mayAskDistributed(t, db, r) {
			t.Fatalf("%s may not ask idem.distributed() up at 12 again", r)
		}
	}
}

// mayAskDistributed calls idem.distributed() as role: true when it
// answered (false, on a single node), false when the role may not.
func mayAskDistributed(t *testing.T, db *sql.DB, role string) bool {
	t.Helper()
	ctx := context.Background()
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SET ROLE `+role); err != nil {
		t.Fatal(err)
	}
	defer conn.ExecContext(ctx, `RESET ROLE`)
	var d bool
	if err := conn.QueryRowContext(ctx, `SELECT idem.distributed()`).Scan(&d); err != nil {
		t.Logf("as %s: %v", role, err)
		return false
	}
	if d {
		t.Fatalf("idem.distributed() on a single node: true")
	}
	return true
}
