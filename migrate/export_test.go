package migrate

import (
	"context"
	"database/sql"
	"fmt"
	"sync"
	"time"

	"github.com/pressly/goose/v3/database"
)

// claimBlocking are the table lock modes that conflict with ROW EXCLUSIVE,
// the lock every claim takes on idem.processed_events and the partition it
// writes: while a step holds one of them, claims wait.
const claimBlocking = `('ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')`

// StepRecord is what one step did to idem.processed_events, as its
// stepProbe saw it in the step's transaction.
type StepRecord struct {
	Version       int64
	Up            bool
	Read, Written int64  // rows of processed_events and its partitions
	Locks         string // claim-blocking locks it holds on them at its end
}

func (r StepRecord) String() string {
	dir := "up"
	if !r.Up {
		dir = "down"
	}
	return fmt.Sprintf("migration %d %s: read %d rows, wrote %d, holding %q", r.Version, dir, r.Read, r.Written, r.Locks)
}

// NewRecorded returns a Migrator whose every step records, in its own
// transaction at its end, what it read and wrote of idem.processed_events
// and the claim-blocking locks it holds (probeRows), and the records so
// far.
func NewRecorded(db *sql.DB, cfg Config) (*Migrator, func() []StepRecord, error) {
	var (
		mu   sync.Mutex
		recs []StepRecord
	)
	cfg.stepProbe = func(ctx context.Context, tx database.DBTxConn, version int64, up bool) error {
		r := StepRecord{Version: version, Up: up}
		var start, end string
		if err := tx.QueryRowContext(ctx, `SELECT pg_catalog.current_setting('idem.probe_rows'), (`+probeRows+`)`).Scan(&start, &end); err != nil {
			return fmt.Errorf("probe: %w", err)
		}
		var r0, w0, r1, w1 int64
		if _, err := fmt.Sscan(start, &r0, &w0); err != nil {
			return fmt.Errorf("probe %q: %w", start, err)
		}
		if _, err := fmt.Sscan(end, &r1, &w1); err != nil {
			return fmt.Errorf("probe %q: %w", end, err)
		}
		r.Read, r.Written = r1-r0, w1-w0
		if err := tx.QueryRowContext(ctx, `
			SELECT CASE WHEN pg_catalog.count(*) = 0 THEN '' ELSE pg_catalog.string_agg(DISTINCT l.mode, ', ') || ' on ' || pg_catalog.count(DISTINCT l.relation) || ' of ' ||
			       (SELECT pg_catalog.count(*) FROM pg_catalog.pg_partition_tree(pg_catalog.to_regclass('idem.processed_events'))) || ' tables' END
			  FROM pg_catalog.pg_locks l
			 WHERE l.pid = pg_catalog.pg_backend_pid() AND l.locktype = 'relation' AND l.granted AND l.mode IN `+claimBlocking+`
			   AND l.relation IN (SELECT relid FROM pg_catalog.pg_partition_tree(pg_catalog.to_regclass('idem.processed_events')))`).Scan(&r.Locks); err != nil {
			return fmt.Errorf("probe locks: %w", err)
		}
		mu.Lock()
		recs = append(recs, r)
		mu.Unlock()
		return nil
	}
	m, err := New(db, cfg)
	return m, func() []StepRecord {
		mu.Lock()
		defer mu.Unlock()
		return append([]StepRecord(nil), recs...)
	}, err
}

// OnlineIndex is an index a migration creates on idem.processed_events.
type OnlineIndex struct {
	Name, Def string
	Unique    bool
}

// OnlineIndexes parses section as guardedFS does.
func OnlineIndexes(file, section string) ([]OnlineIndex, error) {
	ix, err := onlineIndexes(file, section)
	var out []OnlineIndex
	for _, i := range ix {
		out = append(out, OnlineIndex{i.name, i.def, i.unique})
	}
	return out, err
}

// EmbeddedOnlineIndexes returns the indexes the embedded migration version
// creates on idem.processed_events in its Up (up) or Down section.
func EmbeddedOnlineIndexes(version int64, up bool) ([]OnlineIndex, error) {
	_, online, err := guardedFS(time.Second, false)
	var out []OnlineIndex
	for _, i := range online[onlineKey{version, up}] {
		out = append(out, OnlineIndex{i.name, i.def, i.unique})
	}
	return out, err
}

// ChildIndexName is childIndexName of the index name with definition def.
func ChildIndexName(partition, name, def string) string {
	return childIndexName(partition, onlineIndex{name: name, def: def})
}
