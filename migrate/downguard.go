package migrate

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"regexp"
	"sort"
	"strings"

	"github.com/pressly/goose/v3"

	"github.com/idemkit/idem/sql/migrations"
)

// ErrWouldLoseState: a down migration would drop stored state other than
// the keys (inbox holds, an adoption in progress, policies' settings, run
// history, ...); the error says what. See GuardDown.
var ErrWouldLoseState = errors.New("idem/migrate: migrating down would drop stored state")

// Loss is stored state a down migration would drop.
type Loss struct {
	Version int64  // the migration whose Down drops it
	Object  string // idem.holds, or idem.policies.count_per_key for a column
	Rows    int64  // rows of the table, or rows whose column is not its default
}

func (l Loss) String() string {
	if strings.Count(l.Object, ".") == 2 {
		return fmt.Sprintf("%s: set on %d rows (dropped by migration %d's Down)", l.Object, l.Rows, l.Version)
	}
	return fmt.Sprintf("%s: %d rows (dropped by migration %d's Down)", l.Object, l.Rows, l.Version)
}

// What a Down drops, read from its top-level statements.
var (
	dropTable  = regexp.MustCompile(`(?m)^DROP TABLE (?:IF EXISTS )?(idem\.[a-z_]+)`)
	dropColumn = regexp.MustCompile(`(?m)^ALTER TABLE (idem\.[a-z_]+) DROP COLUMN (?:IF EXISTS )?([a-z_]+)`)
)

// notState are the tables a Down drops whose rows are not an
// installation's state: written by the migrations themselves, derived from
// other tables, or held only while a call runs. Every other table a Down
// drops (the keys, the policies, the inbox's holds, an adoption, the
// maintenance runs' history) is state, and so is a column it drops.
var notState = map[string]bool{
	"idem.rights":            true, // the roles' rights, written by migration 12
	"idem.lookbacks":         true, // the longest ttl each source has had, which claims before 5 do not read
	"idem.duplicate_counts":  true, // duplicate counters not yet folded into the keys' rows
	"idem.queue_counts":      true, // the inbox's queue counters, recounted from holds
	"idem.activity":          true, // the dashboard's per-minute counters
	"idem.source_snapshots":  true, // the dashboard's per-source figures, taken again on demand
	"idem.waiters":           true, // callers waiting on a key right now
	"idem.maintenance_locks": true, // the maintenance locks held right now
	"idem.claim_settings":    true, // derived from policies, lookbacks, holds and adoptions by triggers
}

// Losses returns what migrating down from version from to version to would
// drop: for each migration in (to, from], the tables its Down drops that
// hold rows and the columns it drops that hold other than their default.
func Losses(ctx context.Context, db *sql.DB, from, to int64) ([]Loss, error) {
	entries, err := fs.ReadDir(migrations.FS, ".")
	if err != nil {
		return nil, err
	}
	var out []Loss
	for _, e := range entries {
		v, err := goose.NumericComponent(e.Name())
		if err != nil || v <= to || v > from || !strings.HasSuffix(e.Name(), ".sql") {
			continue
		}
		b, err := fs.ReadFile(migrations.FS, e.Name())
		if err != nil {
			return nil, err
		}
		_, down, _ := strings.Cut(string(b), "-- +goose Down\n")
		for _, m := range dropTable.FindAllStringSubmatch(down, -1) {
			if notState[m[1]] {
				continue
			}
			n, err := countRows(ctx, db, m[1], "")
			if err != nil {
				return nil, err
			}
			if n > 0 {
				out = append(out, Loss{Version: v, Object: m[1], Rows: n})
			}
		}
		for _, m := range dropColumn.FindAllStringSubmatch(down, -1) {
			n, err := countRows(ctx, db, m[1], m[2])
			if err != nil {
				return nil, err
			}
			if n > 0 {
				out = append(out, Loss{Version: v, Object: m[1] + "." + m[2], Rows: n})
			}
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Version != out[j].Version {
			return out[i].Version > out[j].Version
		}
		return out[i].Object < out[j].Object
	})
	return out, nil
}

// ownRows narrows what is counted of a table some of whose rows a
// migration writes: migration 1 writes the default policy, '*'.
var ownRows = map[string]string{"idem.policies": "source <> '*'"}

// countRows counts the rows of table, or those whose column is not its
// default (not NULL when it has none); 0 when the table or column is not
// there.
func countRows(ctx context.Context, db *sql.DB, table, column string) (int64, error) {
	var expr sql.NullString
	var exists bool
	err := db.QueryRowContext(ctx, `
		SELECT pg_catalog.to_regclass($1) IS NOT NULL AND ($2 = '' OR EXISTS (
		         SELECT FROM pg_catalog.pg_attribute a WHERE a.attrelid = pg_catalog.to_regclass($1) AND a.attname = $2 AND NOT a.attisdropped)),
		       (SELECT pg_catalog.pg_get_expr(d.adbin, d.adrelid) FROM pg_catalog.pg_attrdef d
		          JOIN pg_catalog.pg_attribute a ON a.attrelid = d.adrelid AND a.attnum = d.adnum
		         WHERE d.adrelid = pg_catalog.to_regclass($1) AND a.attname = $2)`, table, column).Scan(&exists, &expr)
	if err != nil || !exists {
		return 0, err
	}
	q := "SELECT count(*) FROM " + table // table and column come from the embedded migrations
	if w, ok := ownRows[table]; ok && column == "" {
		q += " WHERE " + w
	}
	if column != "" {
		q += " WHERE " + column + " IS NOT NULL"
		if expr.Valid {
			q = "SELECT count(*) FROM " + table + " WHERE " + column + " IS DISTINCT FROM (" + expr.String + ")"
		}
	}
	var n int64
	if err := db.QueryRowContext(ctx, q).Scan(&n); err != nil {
		return 0, fmt.Errorf("idem/migrate: count what the down would drop (%s): %w", table, err)
	}
	return n, nil
}

// GuardDown refuses a migration of p down to version that would drop
// stored state, unless force is set: with ErrWouldDropKeys when it would
// drop the stored keys (a down below version 1), with ErrWouldLoseState
// otherwise; the error lists every loss (Losses) and says how to go ahead.
func GuardDown(ctx context.Context, db *sql.DB, p *goose.Provider, version int64, force bool) error {
	if force {
		return nil
	}
	current, err := p.GetDBVersion(ctx)
	if err != nil || current <= version {
		return err
	}
	losses, err := Losses(ctx, db, current, version)
	if err != nil || len(losses) == 0 {
		return err
	}
	lines := make([]string, len(losses))
	sentinel := ErrWouldLoseState
	for i, l := range losses {
		lines[i] = l.String()
		if l.Object == "idem.processed_events" {
			sentinel = ErrWouldDropKeys
			lines[i] = fmt.Sprintf("%d keys are stored", l.Rows)
		}
	}
	return fmt.Errorf("%w: %s; pass force (idemctl migrate down --force) to drop them", sentinel, strings.Join(lines, "; "))
}
