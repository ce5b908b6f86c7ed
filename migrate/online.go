package migrate

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"regexp"
	"strings"
	"time"
)

// Online index builds.
//
// A plain CREATE INDEX on idem.processed_events takes a SHARE lock on the
// table and every partition and holds it, with the rest of its step's
// transaction, for the whole build: every claim's insert or update waits
// for it (migration 19 at 2,000,000 keys: 1.5 to 29 s, docs/performance.md). CREATE INDEX
// CONCURRENTLY takes only SHARE UPDATE EXCLUSIVE, which claims do not
// conflict with, but cannot run in a transaction (each of idem's steps is
// one) nor on a partitioned table.
//
// So before it applies a step whose section (Up, or Down when rolling
// back) creates an index on idem.processed_events, the Migrator builds that
// index on each partition with CREATE INDEX CONCURRENTLY, outside any
// transaction (buildOnline). The step's own CREATE INDEX then finds a
// matching valid index on every partition and attaches it instead of
// building one (PostgreSQL does that for an index on a partitioned table):
// its SHARE locks are held for the catalog work only, whatever the number
// of keys. A partition made after the online build (a rotation) gets its
// index from the step, built on the few rows a new month holds.
//
// Migrations are history and are not edited: the statement the step runs
// is the one in its file. An index is recognised by a line of its own:
//
//	CREATE [UNIQUE] INDEX name ON idem.processed_events USING method (...) [...];
//
// written as PostgreSQL's pg_get_indexdef writes it (buildOnline checks
// that, so the step's statement and the partitions' indexes match); any
// other CREATE INDEX on idem.processed_events is refused when the Provider
// is made. Only the Migrator (New, Up, DownTo, idemctl migrate) builds
// online; a bare NewProvider's Up runs the step's CREATE INDEX as written.

// onlineIndex is an index a step creates on idem.processed_events.
type onlineIndex struct {
	name   string // the index on idem.processed_events
	unique bool
	def    string // from USING on, as pg_get_indexdef writes it
}

// onlineKey says which section of which migration creates the indexes.
type onlineKey struct {
	version int64
	up      bool
}

var (
	createIndexLine = regexp.MustCompile(`(?m)^CREATE (UNIQUE )?INDEX ([a-z_][a-z0-9_]*) ON idem\.processed_events ((?:USING [a-z]+ )?\(.*\)[^;]*);[ \t]*$`)
	anyCreateIndex  = regexp.MustCompile(`(?im)^[ \t]*CREATE[ \t]+(UNIQUE[ \t]+)?INDEX\b[^;]*?\bidem\.processed_events`)
)

// onlineIndexes returns the indexes a migration section creates on
// idem.processed_events, refusing one written in a form it cannot build
// online first.
func onlineIndexes(file, section string) ([]onlineIndex, error) {
	var out []onlineIndex
	for _, m := range createIndexLine.FindAllStringSubmatch(section, -1) {
		out = append(out, onlineIndex{name: m[2], unique: m[1] != "", def: m[3]})
	}
	if n := len(anyCreateIndex.FindAllString(section, -1)); n != len(out) {
		return nil, fmt.Errorf("idem/migrate: %s creates an index on idem.processed_events the migrator cannot build online first: "+
			"write it on one line as `CREATE INDEX name ON idem.processed_events USING btree (...);` (no CONCURRENTLY, IF NOT EXISTS or ONLY), "+
			"so that each partition's index is built concurrently before the step and the step attaches them", file)
	}
	return out, nil
}

// childIndexName is the name of the index built on partition for the
// index ix on idem.processed_events: the name PostgreSQL would choose
// (partition, columns, _idx), else the partition's name and the index's,
// or, past PostgreSQL's 63 bytes, a digest of both. The same partition and
// index always give the same name, so an interrupted build is found again.
func childIndexName(partition string, ix onlineIndex) string {
	// The name PostgreSQL gives the index when it creates it on a new
	// partition (idem.make_month's CREATE TABLE ... INCLUDING INDEXES): the
	// table and the columns, then _idx. So that a month built online and a
	// month made later carry their index under names of one form.
	if m := plainColumns.FindStringSubmatch(ix.def); m != nil {
		n := partition + "_" + strings.Join(strings.Split(m[1], ", "), "_") + "_idx"
		if len(n) <= 63 {
			return n
		}
	}
	n := partition + "_" + strings.TrimPrefix(ix.name, "processed_events_")
	if len(n) <= 63 {
		return n
	}
	sum := sha256.Sum256([]byte(partition + "." + ix.name))
	return "idem_online_" + hex.EncodeToString(sum[:12])
}

// plainColumns matches an index definition over plain columns, with no
// expression, collation, operator class or ordering.
var plainColumns = regexp.MustCompile(`^USING \w+ \(([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*)\)`)

func quoteIdent(s string) string { return `"` + strings.ReplaceAll(s, `"`, `""`) + `"` }

// ErrOnlineIndex: buildOnline found, under the name it builds a
// partition's index with, an index that is not the one the migration
// creates.
var ErrOnlineIndex = errors.New("idem/migrate: an index in the way of an online index build")

// buildOnline builds the indexes of migration key on every partition of
// idem.processed_events with CREATE INDEX CONCURRENTLY, unless the step is
// done already. It is resumable: an index already built is kept; an invalid
// one (a build interrupted by a crash, a cancel or a lost connection) is
// dropped concurrently and built again, after waiting for a build still
// running in a backend whose client went away.
//
// Two migrators do not build at once: a transaction on a connection of
// its own holds the advisory lock OnlineLockID for the whole build (so it
// holds through a transaction pooler). It is not the migration lock, and
// it is waited for by polling from the client, not in a statement: CREATE
// INDEX CONCURRENTLY waits for every transaction in the database holding a
// snapshot older than its own, and a step waiting for the migration lock
// (LockStatement polls inside one statement, holding its snapshot) or a
// statement left open in the guard would be waited for while it waits for
// the build: a deadlock until LockWait. The guard runs its statements in
// the simple protocol (no portal is left open) in READ COMMITTED, so it
// holds no snapshot between them. No lock_timeout is set: the builds' waits
// (for transactions writing the partition, then for older snapshots) block
// no claim; a transaction left open stops the build there, as it would any
// CREATE INDEX CONCURRENTLY, until it ends or ctx is cancelled (the build
// then resumes at the next migrate up).
func (m *Migrator) buildOnline(ctx context.Context, key onlineKey, indexes []onlineIndex) error {
	// Done already (the schema is up to date, or another migrator did the
	// step): nothing to build and no lock to take, so a session holding the
	// lock's id stops no migrate up that has nothing to build.
	done := func(q queryRower) (bool, error) {
		var table bool
		if err := q.QueryRowContext(ctx, `SELECT pg_catalog.to_regclass('idem.processed_events') IS NOT NULL
		                                        AND pg_catalog.to_regclass('`+TableName+`') IS NOT NULL`).Scan(&table); err != nil || !table {
			return true, err // no table yet: the step makes it
		}
		var applied bool
		if err := q.QueryRowContext(ctx, `SELECT EXISTS (SELECT FROM `+TableName+` WHERE version_id = $1 AND is_applied)`, key.version).Scan(&applied); err != nil {
			return true, err
		}
		return applied == key.up, nil
	}
	if d, err := done(m.db); d || err != nil {
		return err
	}
	// A distributed installation (Citus) keeps the step's own build, as
	// before: building a distributed partition's index concurrently and
	// attaching it on every shard is not tested here (docs/citus.md).
	if d, err := Distributed(ctx, m.db); d || err != nil {
		if d {
			m.cfg.Logger.WarnContext(ctx, "idem/migrate: a distributed installation: the step builds its index itself, holding claims for the build",
				slog.Int64("migration", key.version))
		}
		return err
	}
	// The builds run on a connection outside any transaction, the guard on
	// another, taken only when there is something to build: a pool of one
	// connection (MaxOpenConns 1) would wait for ever for the second.
	acquire := func(second bool) (*sql.Conn, error) {
		if second && m.db.Stats().MaxOpenConnections == 1 {
			return nil, fmt.Errorf("idem/migrate: the online index build of migration %d needs two connections (one holds its lock): the pool allows one", key.version)
		}
		actx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		c, err := m.db.Conn(actx)
		if err != nil {
			return nil, fmt.Errorf("idem/migrate: the online index build of migration %d needs two connections (one holds its lock): %w", key.version, err)
		}
		return c, nil
	}
	conn, err := acquire(false)
	if err != nil {
		return err
	}
	defer conn.Close()
	guardConn, err := acquire(true)
	if err != nil {
		return err
	}
	defer guardConn.Close()
	guard, err := guardConn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return err
	}
	defer guard.Rollback() //nolint:errcheck // a guard: nothing to keep
	for deadline := time.Now().Add(LockWait); ; {
		// Exec without arguments: the simple protocol. The command tag
		// (SELECT 1 or SELECT 0) says whether the lock was taken.
		res, err := guard.ExecContext(ctx, fmt.Sprintf(`SELECT 1 WHERE pg_catalog.pg_try_advisory_xact_lock(%d::bigint)`, OnlineLockID))
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 1 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w: the online index build lock (advisory lock %d) was held for %v: another migrator building, or a session of any role holding pg_advisory_lock(%d); "+
				"SELECT pid, usename, state FROM pg_catalog.pg_locks l JOIN pg_catalog.pg_stat_activity a USING (pid) WHERE l.locktype = 'advisory' names its holder: end that session, then migrate again",
				ErrLocked, OnlineLockID, LockWait, OnlineLockID)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	if d, err := done(conn); d || err != nil {
		return err // another migrator did the step meanwhile
	}
	rows, err := conn.QueryContext(ctx, `
		SELECT c.relname, c.relkind::text
		  FROM pg_catalog.pg_inherits i
		  JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) i.inhrelid
		 WHERE i.inhparent OPERATOR(pg_catalog.=) 'idem.processed_events'::pg_catalog.regclass
		 ORDER BY c.relname`)
	if err != nil {
		return err
	}
	var partitions []string
	for rows.Next() {
		var name, kind string
		if err := rows.Scan(&name, &kind); err != nil {
			rows.Close()
			return err
		}
		if kind != "r" {
			rows.Close()
			return fmt.Errorf("idem/migrate: partition idem.%s of idem.processed_events is partitioned itself (relkind %s): idem makes plain monthly partitions only", name, kind)
		}
		partitions = append(partitions, name)
	}
	if err := rows.Close(); err != nil {
		return err
	}
	for _, ix := range indexes {
		for _, part := range partitions {
			m.cfg.Logger.InfoContext(ctx, "idem/migrate: building an index concurrently before the step that attaches it (it waits for transactions older than it, blocking no claim)",
				slog.Int64("migration", key.version), slog.String("index", childIndexName(part, ix)), slog.String("partition", "idem."+part))
			start := time.Now()
			built, err := buildPartitionIndex(ctx, conn, part, ix)
			if err != nil {
				return fmt.Errorf("idem/migrate: migration %d: index %s on idem.%s: %w", key.version, childIndexName(part, ix), part, err)
			}
			if built {
				m.cfg.Logger.InfoContext(ctx, "idem/migrate: built",
					slog.Int64("migration", key.version), slog.String("index", childIndexName(part, ix)),
					slog.Duration("took", time.Since(start).Round(time.Millisecond)))
			}
		}
	}
	return nil
}

// buildPartitionIndex makes ix's index on partition valid, building it
// concurrently (again, if an interrupted build left it invalid); built says
// whether it built.
func buildPartitionIndex(ctx context.Context, conn *sql.Conn, partition string, ix onlineIndex) (built bool, err error) {
	name := childIndexName(partition, ix)
	unique := ""
	if ix.unique {
		unique = "UNIQUE "
	}
	for attempt := 0; ; attempt++ {
		var (
			exists, valid, wasUnique, running bool
			def                               string
		)
		// A build running in another backend (its client gone: a server
		// backend finishes a statement it is running) shows in
		// pg_stat_progress_create_index for the partition.
		err := conn.QueryRowContext(ctx, `
			SELECT i.indexrelid IS NOT NULL, coalesce(i.indisvalid, false), coalesce(i.indisunique, false),
			       coalesce(pg_catalog.pg_get_indexdef(i.indexrelid), ''),
			       EXISTS (SELECT FROM pg_catalog.pg_stat_progress_create_index p
			                WHERE p.relid OPERATOR(pg_catalog.=) t.oid AND p.pid OPERATOR(pg_catalog.<>) pg_catalog.pg_backend_pid())
			  FROM pg_catalog.pg_class t
			  LEFT JOIN (pg_catalog.pg_class c
			             JOIN pg_catalog.pg_index i ON i.indexrelid OPERATOR(pg_catalog.=) c.oid)
			    ON c.relname OPERATOR(pg_catalog.=) $2 AND c.relnamespace OPERATOR(pg_catalog.=) t.relnamespace
			 WHERE t.relname OPERATOR(pg_catalog.=) $1 AND t.relnamespace OPERATOR(pg_catalog.=) 'idem'::pg_catalog.regnamespace`,
			partition, name).Scan(&exists, &valid, &wasUnique, &def, &running)
		if errors.Is(err, sql.ErrNoRows) {
			return built, nil // the partition was retired meanwhile
		}
		if err != nil {
			return built, err
		}
		if exists {
			_, got, _ := strings.Cut(def, " USING ")
			if "USING "+got != ix.def || wasUnique != ix.unique {
				return built, fmt.Errorf("%w: it reads %q, the migration creates %q: "+
					"if idem built it, write the migration's CREATE INDEX as PostgreSQL writes the index (pg_get_indexdef); otherwise drop or rename it",
					ErrOnlineIndex, def, fmt.Sprintf("CREATE %sINDEX ... %s", unique, ix.def))
			}
		}
		switch {
		case exists && valid:
			return built, nil
		case running:
			// Wait for it: it may finish valid.
			select {
			case <-ctx.Done():
				return built, ctx.Err()
			case <-time.After(time.Second):
			}
			continue
		case exists:
			// An interrupted build's leftover: it is updated by every
			// write but answers no query. Built again from the start.
			if _, err := conn.ExecContext(ctx, "DROP INDEX CONCURRENTLY IF EXISTS idem."+quoteIdent(name)); err != nil {
				return built, err
			}
		}
		if attempt > 2 {
			return built, fmt.Errorf("still not valid after %d builds", attempt)
		}
		if _, err := conn.ExecContext(ctx, fmt.Sprintf("CREATE %sINDEX CONCURRENTLY IF NOT EXISTS %s ON idem.%s %s",
			unique, quoteIdent(name), quoteIdent(partition), ix.def)); err != nil {
			return built, err
		}
		built = true
	}
}
