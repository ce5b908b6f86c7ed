package migrate_test

import (
	"context"
	"slices"
	"testing"
)

// TestUpgradeTo14: from version 13 holding data and roles, the upgrade to
// 14 keeps every answer, gives the maintainer role granted at 13 the new
// maintenance functions (and nothing to the application role), and CALL
// idem.prune() / idem.rotate() run; down to 13 restores the previous
// routines and rights, and up again.
func TestUpgradeTo14(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 13); err != nil {
		t.Fatal(err)
	}
	app, maint := appAndMaintainer(t, db, "idem_up14")
	seedCompleted(t, db)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour')`); err != nil {
		t.Fatal(err)
	}
	at13 := map[string][]string{app: rightsOf(t, db, app), maint: rightsOf(t, db, maint)}
	added := []string{
		"FUNCTION idem.audit() EXECUTE",
		"FUNCTION idem.check_prune_args(integer,integer) EXECUTE",
		"FUNCTION idem.check_rotate_args(integer,interval) EXECUTE",
		"FUNCTION idem.make_month(date) EXECUTE",
		"FUNCTION idem.sql_holder() EXECUTE",
	}
	maintenance := func(stage string) {
		t.Helper()
		for _, call := range []string{`CALL idem.prune()`, `CALL idem.rotate()`} {
			if _, err := db.ExecContext(ctx, call); err != nil {
				t.Fatalf("%s %s: %v", stage, call, err)
			}
		}
	}
	for _, step := range []struct {
		stage string
		up    bool
	}{{"up to 14", true}, {"down to 13", false}, {"up to 14 again", true}} {
		var err error
		if step.up {
			_, err = p.UpTo(ctx, 14)
		} else {
			_, err = p.DownTo(ctx, 13)
		}
		if err != nil {
			t.Fatalf("%s: %v", step.stage, err)
		}
		seededAnswered(t, db, step.stage)
		for r, rights := range at13 {
			want := rights
			if step.up && r == maint {
				want = slices.Sorted(slices.Values(append(slices.Clone(rights), added...)))
			}
			if got := rightsOf(t, db, r); !slices.Equal(got, want) {
				t.Fatalf("%s: %s\n got %v\nwant %v", step.stage, r, got, want)
			}
		}
		maintenance(step.stage)
	}
}
