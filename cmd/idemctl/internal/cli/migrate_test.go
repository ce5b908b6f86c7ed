package cli

import (
	"context"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

func TestMigrateCommand(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	env := map[string]string{"DATABASE_URL": url} // the fallback when --database-url is absent
	steps := []struct {
		args []string
		want string
	}{
		{[]string{"migrate", "up"}, "applied 00016_idem_standby_duplicates.sql"},
		{[]string{"migrate", "up"}, "idem schema is up to date"},
		{[]string{"migrate", "version"}, "16"},
		{[]string{"migrate", "status"}, "00001_idem_core.sql                      applied"},
		{[]string{"migrate", "status", "--citus"}, ""}, // replaced below: --citus is for up
		{[]string{"migrate", "down"}, "rolled back 00016_idem_standby_duplicates.sql"},
		{[]string{"migrate", "down"}, "rolled back 00013_idem_claim_citus.sql"},
		{[]string{"migrate", "down"}, "rolled back 00012_idem_rights.sql"},
		{[]string{"migrate", "down"}, "rolled back 00011_idem_citus.sql"},
		{[]string{"migrate", "down"}, "rolled back 00010_idem_dashboard.sql"},
		{[]string{"migrate", "down"}, "rolled back 00009_idem_adopt.sql"},
		{[]string{"migrate", "down"}, "rolled back 00008_idem_wait.sql"},
		{[]string{"migrate", "down"}, "rolled back 00007_idem_inbox_holds.sql"},
		{[]string{"migrate", "down"}, "rolled back 00006_idem_maintenance_steps.sql"},
		{[]string{"migrate", "down"}, "rolled back 00005_idem_claim_v2.sql"},
		{[]string{"migrate", "up", "--to", "4"}, "idem schema is up to date"},
		{[]string{"migrate", "version"}, "4"},
		{[]string{"migrate", "down", "--to", "0"}, "rolled back 00001_idem_core.sql"},
		{[]string{"migrate", "down"}, "nothing to roll back"},
		{[]string{"migrate", "version"}, "0"},
		{[]string{"migrate", "up"}, "applied 00001_idem_core.sql"},
	}
	for _, s := range steps {
		if len(s.args) == 3 && s.args[2] == "--citus" {
			// --citus elsewhere than up is a usage error; on up without
			// Citus, an error naming what to do, after the migrations.
			if r := idemctl(t, ctx, env, s.args...); r.code != ExitUsage {
				t.Fatalf("%v: %+v, want the usage exit code", s.args, r)
			}
			r := idemctl(t, ctx, env, "migrate", "up", "--citus")
			if r.code == 0 || !strings.Contains(r.errout, "Citus is not installed in this database") {
				t.Fatalf("migrate up --citus without Citus: %+v", r)
			}
			continue
		}
		r := idemctl(t, ctx, env, s.args...)
		if r.code != 0 || !strings.Contains(r.out, s.want) {
			t.Fatalf("%v: exit %d, want output containing %q\nstdout: %s\nstderr: %s", s.args, r.code, s.want, r.out, r.errout)
		}
	}
	// With keys stored, a down to version 0 is refused unless forced.
	pool := testdb.Pool(t, url, 1)
	if _, err := pool.Exec(ctx, `SELECT idem.claim('s', 'k' || g) FROM generate_series(1, 3) g`); err != nil {
		t.Fatal(err)
	}
	r := idemctl(t, ctx, env, "migrate", "down", "--to", "0")
	if r.code != ExitError {
		t.Fatalf("down --to 0 with keys: %+v", r)
	}
	oneLine(t, r.errout, "3 keys are stored; pass force (idemctl migrate down --force) to drop them")
	if r := idemctl(t, ctx, env, "migrate", "down", "--to", "0", "--force"); r.code != 0 || !strings.Contains(r.out, "rolled back 00001_idem_core.sql") {
		t.Fatalf("down --to 0 --force: %+v", r)
	}
}
