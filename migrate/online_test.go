package migrate_test

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/sqlstate"
	"github.com/idemkit/idem/internal/testdb"
	"github.com/idemkit/idem/migrate"
)

// seedPartitions stores rows keys in each monthly partition of
// idem.processed_events, at version 1's columns. The default partition is
// left empty, as it is while rotation keeps the months made: a key lands
// there only when its month has no partition, and creating that partition
// (rotation, or migration 4's premade months) moves it out under an ACCESS
// EXCLUSIVE lock on the default partition, which only claims landing there
// wait for (idem.create_partition).
func seedPartitions(t *testing.T, ctx context.Context, db *sql.DB, rows int) {
	t.Helper()
	now := time.Now().UTC()
	for _, add := range []int{-2, -1} {
		if _, err := db.ExecContext(ctx, `SELECT idem.create_partition($1::date)`, testdb.MonthStart(now, add)); err != nil {
			t.Fatal(err)
		}
	}
	rows2, err := db.QueryContext(ctx, `SELECT relid::regclass::text FROM pg_partition_tree('idem.processed_events')
	                                     WHERE isleaf AND relid <> 'idem.processed_events_default'::regclass`)
	if err != nil {
		t.Fatal(err)
	}
	var parts []string
	for rows2.Next() {
		var p string
		if err := rows2.Scan(&p); err != nil {
			t.Fatal(err)
		}
		parts = append(parts, p)
	}
	if err := rows2.Close(); err != nil {
		t.Fatal(err)
	}
	for _, p := range parts {
		m, err := time.Parse("idem.processed_events_p2006_01", p)
		if err != nil {
			t.Fatalf("partition %s: %v", p, err)
		}
		if _, err := db.ExecContext(ctx, `
			INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, expires_at)
			SELECT 'seed', to_char($1::date, 'YYYY-MM') || '-' || g, $1::date, 'completed', nextval('idem.token_seq'), '{}', $1::date + interval '1 hour', now(),
			       now() + interval '1 day' + g * interval '1 second'
			  FROM generate_series(1, $2) g`, m, rows); err != nil {
			t.Fatal(err)
		}
	}
	var empty int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_partition_tree('idem.processed_events') t
	                                   WHERE t.isleaf AND t.relid <> 'idem.processed_events_default'::regclass AND NOT EXISTS (SELECT FROM idem.processed_events e WHERE e.tableoid = t.relid)`).Scan(&empty); err != nil || empty != 0 {
		t.Fatalf("%d partitions hold no row (%v)", empty, err)
	}
}

// TestNoStepStallsClaims applies every migration, present or future, one
// step at a time, up from version 1 and then down again, to an
// idem.processed_events holding keys in every partition, and fails for a
// step that holds a lock claims wait for (SHARE or stronger, on the table
// or a partition) while it reads or writes stored keys (an index build, a
// constraint's validation, a rewrite, a backfill), or that writes stored
// keys at all (each row it writes stays locked until it commits). Such a
// step holds claims for as long as a pass over the keys takes, which at
// production size is far longer than its lock timeout (migration 19's
// plain CREATE INDEX at 2,000,000 keys: 1.5 to 29 s): the rule is checked
// on counts the step's own transaction reports (stepProbe), not on time, so
// a handful of rows per partition are enough and nothing depends on the
// machine's speed. A step may take such a lock to change the catalog only
// (drop an index, attach an index built online, add a NOT VALID
// constraint, a column without a rewrite): that is as long as its lock
// timeout plus the rest of its transaction, which TestUpgradeUnderClaimLoad
// measures.
func TestNoStepStallsClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sql.Open("pgx", testdb.NewEmpty(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	m, records, err := migrate.NewRecorded(db, migrate.Config{})
	if err != nil {
		t.Fatal(err)
	}
	var versions []int64
	for _, s := range m.Provider().ListSources() {
		versions = append(versions, s.Version)
	}
	if _, err := m.UpTo(ctx, versions[0]); err != nil {
		t.Fatal(err)
	}
	seedPartitions(t, ctx, db, 50)
	for _, v := range versions[1:] {
		if _, err := m.UpTo(ctx, v); err != nil {
			t.Fatalf("up to %d: %v", v, err)
		}
	}
	checkIndexesAttached(t, ctx, db)
	for i := len(versions) - 1; i > 0; i-- {
		if _, err := m.DownTo(ctx, versions[i-1], true); err != nil {
			t.Fatalf("down to %d: %v", versions[i-1], err)
		}
	}
	checkIndexesAttached(t, ctx, db)
	recs := records()
	if want := 2*len(versions) - 1; len(recs) != want {
		t.Fatalf("%d steps recorded, want %d", len(recs), want)
	}
	for _, r := range recs {
		switch {
		case r.Locks != "" && r.Read+r.Written > 0:
			t.Errorf("%v: claims wait for it while it reads or writes stored keys: build an index online (online.go), "+
				"add a constraint NOT VALID and validate it in a later step, never rewrite a partition", r)
		case r.Written > 0:
			t.Errorf("%v: each row it writes stays locked until it commits, so claims of those keys wait: backfill in batches outside the migration", r)
		case r.Locks != "":
			t.Logf("%v (catalog only)", r)
		}
	}
}

// checkIndexesAttached fails if a partition of idem.processed_events holds
// an index that is not attached to one of the table's, or an invalid
// index: a leftover of an online build that no step attached.
func checkIndexesAttached(t *testing.T, ctx context.Context, db *sql.DB) {
	t.Helper()
	var stray string
	if err := db.QueryRowContext(ctx, `
		SELECT coalesce(string_agg(c.relname || CASE WHEN i.indisvalid THEN '' ELSE ' (invalid)' END, ', '), '')
		  FROM pg_partition_tree('idem.processed_events') t
		  JOIN pg_index i ON i.indrelid = t.relid
		  JOIN pg_class c ON c.oid = i.indexrelid
		 WHERE t.level > 0 AND (NOT i.indisvalid OR NOT EXISTS (SELECT FROM pg_inherits h WHERE h.inhrelid = c.oid))`).Scan(&stray); err != nil {
		t.Fatal(err)
	}
	if stray != "" {
		t.Errorf("indexes on partitions attached to no index of idem.processed_events: %s", stray)
	}
}

// TestOnlineIndexParse: the statement of migration 19 is found, and a
// CREATE INDEX on idem.processed_events in a form that cannot be built
// online first is refused.
func TestOnlineIndexParse(t *testing.T) {
	t.Parallel()
	if got, err := migrate.EmbeddedOnlineIndexes(19, true); err != nil || len(got) != 1 || got[0].Name != "processed_events_expires_order_idx" || got[0].Def != "USING btree (expires_at, source, key)" {
		t.Errorf("migration 19's Up: %+v %v", got, err)
	}
	if got, err := migrate.EmbeddedOnlineIndexes(22, false); err != nil || len(got) != 1 || got[0].Name != "processed_events_expires_at_idx" {
		t.Errorf("migration 22's Down: %+v %v", got, err)
	}
	for _, bad := range []string{

		"CREATE INDEX x ON ONLY idem.processed_events USING btree (expires_at);",
		"CREATE INDEX IF NOT EXISTS x ON idem.processed_events USING btree (expires_at);",
		"create index x on idem.processed_events using btree (expires_at);",
		"CREATE INDEX x\n    ON idem.processed_events USING btree (expires_at);",
		"  CREATE UNIQUE INDEX x ON idem.processed_events_p2026_01 USING btree (key);",
	} {
		if _, err := migrate.OnlineIndexes("bad.sql", bad); err == nil || !strings.Contains(err.Error(), "online") {
			t.Errorf("%q: %v, want a refusal", bad, err)
		}
	}
	got, err := migrate.OnlineIndexes("good.sql", "CREATE UNIQUE INDEX y ON idem.processed_events USING btree (source, key, first_seen_month) WHERE (status = 'failed'::text);\n")
	if err != nil || len(got) != 1 || !got[0].Unique || got[0].Def != "USING btree (source, key, first_seen_month) WHERE (status = 'failed'::text)" {
		t.Errorf("a unique partial index: %+v %v", got, err)
	}
	// The name PostgreSQL gives the index on a partition made later.
	if n := migrate.ChildIndexName("processed_events_p2026_11", "processed_events_expires_order_idx", "USING btree (expires_at, source, key)"); n != "processed_events_p2026_11_expires_at_source_key_idx" {
		t.Errorf("child name %q", n)
	}
	if n := migrate.ChildIndexName("processed_events_p2026_11", "processed_events_lower_idx", "USING btree (lower(key))"); n != "processed_events_p2026_11_lower_idx" {
		t.Errorf("child name of an expression index %q", n)
	}
	if n := migrate.ChildIndexName(strings.Repeat("p", 60), "processed_events_expires_order_idx", "USING btree (expires_at, source, key)"); len(n) > 63 ||
		n != migrate.ChildIndexName(strings.Repeat("p", 60), "processed_events_expires_order_idx", "USING btree (expires_at, source, key)") {
		t.Errorf("a long child name %q", n)
	}
}

// TestOnlineIndexResumes: an online build of migration 19's index that
// was interrupted (one partition's index left invalid by a build that
// timed out, another's built) is finished by the next migrate up: the
// invalid one is dropped and built again, the built one kept, and step 19
// attaches them all. An index of another definition under the name the
// build uses is refused (ErrOnlineIndex), nothing of step 19 applied.
func TestOnlineIndexResumes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	m, err := migrate.New(db, migrate.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.UpTo(ctx, 18); err != nil {
		t.Fatal(err)
	}
	seedPartitions(t, ctx, db, 50)
	now := time.Now().UTC()
	part := func(add int) string { return "processed_events_p" + testdb.MonthStart(now, add).Format("2006_01") }
	child := func(add int) string {
		return migrate.ChildIndexName(part(add), "processed_events_expires_order_idx", "USING btree (expires_at, source, key)")
	}

	// Month -1: a build interrupted after its catalog entry was made (it
	// timed out waiting for a transaction writing the partition).
	app, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := app.ExecContext(ctx, `UPDATE idem.`+part(-1)+` SET duplicates = duplicates + 1 WHERE key = $1`, testdb.MonthStart(now, -1).Format("2006-01")+"-1"); err != nil {
		t.Fatal(err)
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.ExecContext(ctx, `SET lock_timeout = '200ms'`); err != nil {
		t.Fatal(err)
	}
	_, err = conn.ExecContext(ctx, `CREATE INDEX CONCURRENTLY `+child(-1)+` ON idem.`+part(-1)+` USING btree (expires_at, source, key)`)
	if sqlstate.Of(err) != sqlstate.LockNotAvailable {
		t.Fatalf("the build to interrupt: %v, want a lock timeout", err)
	}
	_ = conn.Close()
	if err := app.Rollback(); err != nil {
		t.Fatal(err)
	}
	// Month -2: built before the interruption.
	if _, err := db.ExecContext(ctx, `CREATE INDEX CONCURRENTLY `+child(-2)+` ON idem.`+part(-2)+` USING btree (expires_at, source, key)`); err != nil {
		t.Fatal(err)
	}
	oid := func(name string) (o int64) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT coalesce((SELECT oid::bigint FROM pg_class WHERE relname = $1 AND relnamespace = 'idem'::regnamespace), 0)`, name).Scan(&o); err != nil {
			t.Fatal(err)
		}
		return o
	}
	var valid bool
	if err := db.QueryRowContext(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = $1::oid`, oid(child(-1))).Scan(&valid); err != nil || valid {
		t.Fatalf("the interrupted build's index: valid %v (%v), want an invalid leftover", valid, err)
	}
	invalidOID, builtOID := oid(child(-1)), oid(child(-2))

	// Month 0: somebody's index under the build's name.
	if _, err := db.ExecContext(ctx, `CREATE INDEX `+child(0)+` ON idem.`+part(0)+` (key)`); err != nil {
		t.Fatal(err)
	}
	_, err = m.Up(ctx)
	if !errors.Is(err, migrate.ErrOnlineIndex) || !strings.Contains(err.Error(), child(0)) {
		t.Fatalf("up with another index under the build's name: %v, want ErrOnlineIndex naming it", err)
	}
	if v, err := m.Provider().GetDBVersion(ctx); err != nil || v != 18 {
		t.Fatalf("after the refusal: version %d (%v), want 18", v, err)
	}
	if _, err := db.ExecContext(ctx, `DROP INDEX idem.`+child(0)); err != nil {
		t.Fatal(err)
	}

	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("up after the interrupted build: %v", err)
	}
	if o := oid(child(-1)); o == 0 || o == invalidOID {
		t.Errorf("the invalid leftover was not built again (oid %d, was %d)", o, invalidOID)
	}
	if o := oid(child(-2)); o != builtOID {
		t.Errorf("the index built before was not kept (oid %d, was %d)", o, builtOID)
	}
	if err := db.QueryRowContext(ctx, `SELECT indisvalid FROM pg_index WHERE indexrelid = 'idem.processed_events_expires_order_idx'::regclass`).Scan(&valid); err != nil || !valid {
		t.Fatalf("migration 19's index: valid %v (%v)", valid, err)
	}
	var attached int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'idem.processed_events_expires_order_idx'::regclass`).Scan(&attached); err != nil {
		t.Fatal(err)
	}
	var partitions int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_inherits WHERE inhparent = 'idem.processed_events'::regclass`).Scan(&partitions); err != nil || attached != partitions {
		t.Fatalf("%d partitions' indexes attached to migration 19's index, of %d partitions (%v)", attached, partitions, err)
	}
	checkIndexesAttached(t, ctx, db)
}

// TestOnlineBuildNeedsTwoConnections: with a pool of one connection, an
// up with an index to build fails at once saying it needs two, nothing of
// step 19 applied; an up with nothing to build (the schema up to date)
// still works with one.
func TestOnlineBuildNeedsTwoConnections(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sql.Open("pgx", testdb.NewEmpty(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	m, err := migrate.New(db, migrate.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.UpTo(ctx, 18); err != nil {
		t.Fatalf("up to 18 with one connection: %v", err)
	}
	_, err = m.Up(ctx)
	if err == nil || !strings.Contains(err.Error(), "needs two connections") {
		t.Fatalf("up past 18 with one connection: %v, want a refusal saying it needs two", err)
	}
	if v, err := m.Provider().GetDBVersion(ctx); err != nil || v != 18 {
		t.Fatalf("after the refusal: version %d (%v), want 18", v, err)
	}
	db.SetMaxOpenConns(2)
	if _, err := m.Up(ctx); err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(1)
	if _, err := m.Up(ctx); err != nil {
		t.Fatalf("an up to date schema with one connection: %v", err)
	}
}
