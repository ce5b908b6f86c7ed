// Package upgradeload stores keys and claims them while a migration runs,
// measuring how long each claim took and how long claims waited on a lock
// the migration held or asked for (pg_locks, not wall time). The migrate
// package's TestUpgradeUnderClaimLoad and the bench's upgrade section use
// it.
package upgradeload

import (
	"context"
	"crypto/md5"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// MigratorApp is the application_name the migrating connections carry, by
// which the monitor tells a wait on the migration from a wait on a claim.
const MigratorApp = "idem-upgrade-migrator"

// Seed stores keys completed keys of source 'stored', spread over the
// monthly partitions that exist (at any version of idem's schema: the
// columns written are version 1's), in batches of 100,000. A key reads as
// a sender's event id ("evt_" and 32 hex digits, StoredKey) in no order,
// with an expiry in the next 20 to 30 days: an index on them is built as
// on real keys, not on presorted ones.
func Seed(ctx context.Context, pool *pgxpool.Pool, keys int) error {
	rows, err := pool.Query(ctx, `SELECT pg_catalog.substr(c.relname, 19)
	                                FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
	                               WHERE i.inhparent = 'idem.processed_events'::regclass AND c.relname ~ '^processed_events_p[0-9]{4}_[0-9]{2}$'
	                                 AND pg_catalog.to_date(pg_catalog.substr(c.relname, 19), 'YYYY_MM') <= pg_catalog.now()
	                               ORDER BY 1`)
	if err != nil {
		return err
	}
	var months []time.Time
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			return err
		}
		m, err := time.Parse("2006_01", s)
		if err != nil {
			return err
		}
		months = append(months, m)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if len(months) == 0 {
		return errors.New("upgradeload: no monthly partition up to this month")
	}
	const batch = 100_000
	for from := 0; from < keys; from += batch {
		to := min(from+batch, keys)
		m := months[(from/batch)%len(months)]
		if _, err := pool.Exec(ctx, `
			INSERT INTO idem.processed_events (source, key, first_seen_month, status, token, result, first_seen, updated_at, expires_at)
			SELECT 'stored', 'evt_' || pg_catalog.md5(g::text), $1::date, 'completed', nextval('idem.token_seq'), '{"ok": true}', $1::date + interval '1 hour', now(),
			       now() + interval '20 days' + pg_catalog.random() * interval '10 days'
			  FROM generate_series($2::bigint, $3::bigint) g`, m, from+1, to); err != nil {
			return fmt.Errorf("upgradeload: store keys %d to %d: %w", from+1, to, err)
		}
	}
	_, err = pool.Exec(ctx, `ANALYZE idem.processed_events`)
	return err
}

// StoredKey is the key of the nth stored key (from 1).
func StoredKey(n int) string { return fmt.Sprintf("evt_%x", md5.Sum([]byte(strconv.Itoa(n)))) }

// Load is clients claiming (new keys and duplicates of stored ones) until
// Stop, and a monitor sampling pg_locks.
type Load struct {
	stop    atomic.Bool
	wg      sync.WaitGroup
	claims  atomic.Int64
	longest atomic.Int64
	mu      sync.Mutex
	errs    []error
	wait    time.Duration // the longest wait behind the migration seen
	waitOn  string        // what the migration ran then
	monErr  error
}

// Result is what a Load saw.
type Result struct {
	Claims  int64
	Longest time.Duration // the longest claim, wall time
	// LongestWait is the longest a claim was seen waiting (pg_locks'
	// waitstart, sampled every 10 ms) on a lock a migrating backend
	// (application_name MigratorApp) held or was queued for ahead of it;
	// WaitedOn is that backend's statement then. Only this database's
	// backends are looked at: tests on other databases of the same server
	// run their own migrations and loads.
	LongestWait time.Duration
	WaitedOn    string
	Errs        []error // claims that failed
}

// Start starts clients claimers on pool and the monitor on a connection of
// its own.
func Start(ctx context.Context, pool *pgxpool.Pool, clients int) (*Load, error) {
	l := &Load{}
	mon, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	for c := range clients {
		l.wg.Go(func() {
			for i := 0; !l.stop.Load(); i++ {
				key := fmt.Sprintf("new-%d-%d-%d", c, i, time.Now().UnixNano())
				source := "load"
				if i%2 == 1 {
					source, key = "stored", StoredKey(1+(c*7919+i*104729)%1000)
				}
				start := time.Now()
				_, err := pool.Exec(ctx, `SELECT idem.claim($1, $2)`, source, key)
				took := time.Since(start)
				if err != nil {
					l.mu.Lock()
					l.errs = append(l.errs, fmt.Errorf("claim %s/%s: %w", source, key, err))
					l.mu.Unlock()
					continue
				}
				l.claims.Add(1)
				for {
					old := l.longest.Load()
					if int64(took) <= old || l.longest.CompareAndSwap(old, int64(took)) {
						break
					}
				}
			}
		})
	}
	l.wg.Go(func() {
		defer mon.Release()
		for !l.stop.Load() {
			var secs float64
			var query string
			err := mon.QueryRow(ctx, `
				SELECT coalesce(pg_catalog.date_part('epoch', pg_catalog.clock_timestamp() - l.waitstart), 0), coalesce(b.query, '')
				  FROM pg_catalog.pg_locks l
				  JOIN pg_catalog.pg_stat_activity w ON w.pid = l.pid
				  JOIN pg_catalog.pg_stat_activity b ON b.pid = ANY (pg_catalog.pg_blocking_pids(l.pid))
				 WHERE NOT l.granted AND w.application_name <> $1 AND b.application_name = $1
				   AND w.datname = pg_catalog.current_database() AND b.datname = pg_catalog.current_database()
				 ORDER BY 1 DESC LIMIT 1`, MigratorApp).Scan(&secs, &query)
			if err != nil && !strings.Contains(err.Error(), "no rows") {
				l.mu.Lock()
				l.monErr = err
				l.mu.Unlock()
				return
			}
			if d := time.Duration(secs * float64(time.Second)); d > l.wait {
				l.mu.Lock()
				l.wait, l.waitOn = d, strings.Join(strings.Fields(query), " ")
				if len(l.waitOn) > 160 {
					l.waitOn = l.waitOn[:160] + "..."
				}
				l.mu.Unlock()
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
	return l, nil
}

// Stop stops the claimers and the monitor and returns what they saw (an
// error if the monitor failed).
func (l *Load) Stop() (Result, error) {
	l.stop.Store(true)
	l.wg.Wait()
	l.mu.Lock()
	defer l.mu.Unlock()
	return Result{Claims: l.claims.Load(), Longest: time.Duration(l.longest.Load()), LongestWait: l.wait, WaitedOn: l.waitOn, Errs: l.errs}, l.monErr
}

// MigratorURL is url (a URL or a key=value connection string) with
// application_name MigratorApp, for the migration's connections.
func MigratorURL(url string) string {
	switch {
	case !strings.Contains(url, "://"):
		return url + " application_name=" + MigratorApp
	case strings.Contains(url, "?"):
		return url + "&application_name=" + MigratorApp
	}
	return url + "?application_name=" + MigratorApp
}
