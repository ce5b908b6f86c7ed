package migrate_test

import (
	"context"
	"database/sql"
	"slices"
	"testing"
)

// TestUpgradeTo12: from version 11 holding data with app and maintainer
// roles granted at 11 (who may not ask idem.distributed() there), the
// upgrade to 12 (the rights as rows of idem.rights) keeps every answer,
// gives those roles idem.distributed() and nothing else new, and a role
// granted at 12 has exactly the rights of one granted at 11 and upgraded;
// down to 11 takes idem.distributed() back and grants as 11 did again; up
// again gives it back.
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
	at11 := map[string][]string{app: rightsOf(t, db, app), maint: rightsOf(t, db, maint)}
	for r, rights := range at11 {
		if len(rights) < 10 || slices.Contains(rights, distributedRight) {
			t.Fatalf("%s at 11: %d rights, idem.distributed() among them: %v", r, len(rights), rights)
		}
		if mayAskDistributed(t, db, r) {
			t.Fatalf("%s may ask idem.distributed() at 11: the test would prove nothing", r)
		}
	}

	if _, err := p.UpTo(ctx, 12); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 12")
	for r, rights := range at11 {
		want := slices.Sorted(slices.Values(append(slices.Clone(rights), distributedRight)))
		if got := rightsOf(t, db, r); !slices.Equal(got, want) {
			t.Fatalf("%s after the upgrade to 12:\n got %v\nwant %v", r, got, want)
		}
		if !mayAskDistributed(t, db, r) {
			t.Fatalf("%s may not ask idem.distributed() at 12", r)
		}
	}
	app12, maint12 := appAndMaintainer(t, db, "idem_up12_at12")
	for r12, r11 := range map[string]string{app12: app, maint12: maint} {
		if got, want := rightsOf(t, db, r12), rightsOf(t, db, r11); !slices.Equal(got, want) {
			t.Fatalf("%s granted at 12 differs from %s granted at 11 and upgraded:\n got %v\nwant %v", r12, r11, got, want)
		}
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT idem.regrant()`).Scan(&n); err != nil || n != 4 {
		t.Fatalf("idem.regrant() at 12: %d roles (%v), want 4", n, err)
	}

	if _, err := p.DownTo(ctx, 11); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 11")
	for r, rights := range at11 {
		if got := rightsOf(t, db, r); !slices.Equal(got, rights) {
			t.Fatalf("%s after down to 11:\n got %v\nwant %v", r, got, rights)
		}
	}
	app11, _ := appAndMaintainer(t, db, "idem_up12_down")
	if got, want := rightsOf(t, db, app11), at11[app]; !slices.Equal(got, want) {
		t.Fatalf("an app role granted after down to 11:\n got %v\nwant %v", got, want)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up to 12 again")
	for _, r := range []string{app, maint, app11} {
		if !mayAskDistributed(t, db, r) {
			t.Fatalf("%s may not ask idem.distributed() up at 12 again", r)
		}
	}
}

const distributedRight = "FUNCTION idem.distributed() EXECUTE"

// rightsOf lists what role may do in schema idem, sorted: "KIND object
// PRIVILEGE" for the schema, its routines and its relations.
func rightsOf(t *testing.T, db *sql.DB, role string) []string {
	t.Helper()
	return queryStrings(t, context.Background(), db, `
		SELECT 'SCHEMA ' || n.nspname || ' ' || a.privilege_type
		  FROM pg_namespace n, aclexplode(n.nspacl) a
		 WHERE n.nspname = 'idem' AND a.grantee = $1::regrole
		UNION ALL
		SELECT 'FUNCTION ' || p.oid::regprocedure::text || ' ' || a.privilege_type
		  FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace, aclexplode(p.proacl) a
		 WHERE n.nspname = 'idem' AND a.grantee = $1::regrole
		UNION ALL
		SELECT 'TABLE ' || c.oid::regclass::text || ' ' || a.privilege_type
		  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace, aclexplode(c.relacl) a
		 WHERE n.nspname = 'idem' AND a.grantee = $1::regrole
		ORDER BY 1`, role)
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
