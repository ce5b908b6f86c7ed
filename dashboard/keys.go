package dashboard

import (
	"context"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/db/pgxdb"
)

// Key listing: a page of keysPage rows among the keysScan rows that expire
// last after the cursor (in the order expires_at, source, key), read on
// the expires_at index.
const (
	keysPage = 50
	keysScan = 20000
)

var statuses = []string{"processing", "stuck", "completed", "failed"}

type keysView struct {
	Source, Key, Status string
	Statuses            []string
	Sources             []string
	ShowResults         bool
	Lookup              bool               // a lookup by source and key
	Found               []pgxdb.DashKeyRow // its rows (one per month it was seen in)
	List                []pgxdb.DashKeysRow
	Scan                int
	// Next is the next page's query string, "" on the last: built by
	// url.Values.Encode, so a template.URL (html/template would escape it
	// again as one query component).
	Next template.URL
}

// keysForm is the keys page's query: a lookup (Key set) or a list.
type keysForm struct {
	Source, Key, Status string
	// The list's cursor: the last row of the page before, the list going
	// on after it in the order (expires_at, source, key) descending
	// (infinity, "", "": the first page).
	Before                  pgtype.Timestamptz
	BeforeSource, BeforeKey string
}

// parseKeysForm reads and checks the keys page's query.
func parseKeysForm(form url.Values) (keysForm, error) {
	kf := keysForm{Source: form.Get("source"), Key: form.Get("key"), Status: form.Get("status"),
		Before:       pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true},
		BeforeSource: form.Get("before_source"), BeforeKey: form.Get("before_key")}
	if kf.Status != "" && !slices.Contains(statuses, kf.Status) {
		return kf, fmt.Errorf("status %q is not one of %v", truncate(kf.Status, 40), statuses)
	}
	if len(kf.Source) > 64 || len(kf.Key) > 512 || len(kf.BeforeSource) > 64 || len(kf.BeforeKey) > 512 {
		return kf, fmt.Errorf("a source is at most 64 bytes and a key at most 512")
	}
	for _, f := range [][2]string{{"source", kf.Source}, {"key", kf.Key}, {"before_source", kf.BeforeSource}, {"before_key", kf.BeforeKey}} {
		if err := checkText(f[0], f[1]); err != nil {
			return kf, err
		}
	}
	if kf.Key != "" && kf.Source == "" {
		return kf, fmt.Errorf("a key lookup needs its source")
	}
	b := form.Get("before")
	if b == "" {
		if kf.BeforeSource != "" || kf.BeforeKey != "" {
			return kf, fmt.Errorf("before_source and before_key need before")
		}
		return kf, nil
	}
	t, err := time.Parse(time.RFC3339Nano, b)
	if err != nil {
		return kf, fmt.Errorf("before %q is not an RFC 3339 time", truncate(b, 40))
	}
	kf.Before = pgtype.Timestamptz{Time: t, Valid: true}
	return kf, nil
}

func (d *Dashboard) keys(w http.ResponseWriter, r *http.Request) {
	kf, err := parseKeysForm(r.URL.Query())
	if err != nil {
		d.badRequest(w, r, "keys", "%v", err)
		return
	}
	v := keysView{Source: kf.Source, Key: kf.Key, Status: kf.Status, Statuses: statuses,
		ShowResults: d.cfg.ShowResults, Scan: keysScan}
	p, cancel, ok := d.page(w, r)
	defer cancel()
	if !ok {
		return
	}
	ctx, q, now := p.ctx, p.q, p.now
	policies, err := q.DashPolicies(ctx)
	if err != nil {
		d.fail(w, r, "policies", err)
		return
	}
	for _, pol := range policies {
		if pol.Source != "*" {
			v.Sources = append(v.Sources, pol.Source)
		}
	}
	if v.Key != "" {
		v.Lookup = true
		v.Found, err = q.DashKey(ctx, pgxdb.DashKeyParams{Source: v.Source, Key: v.Key, WithResult: d.cfg.ShowResults})
		if err != nil {
			d.fail(w, r, "the key", err)
			return
		}
		d.render(w, r, http.StatusOK, "keys", "keys", "Keys", now, v)
		return
	}
	if v.List, err = d.listKeys(ctx, kf, v.Source, v.Status); err != nil {
		d.fail(w, r, "keys", err)
		return
	}
	if len(v.List) == keysPage {
		last := v.List[len(v.List)-1]
		next := url.Values{"before": {last.ExpiresAt.Time.Format(time.RFC3339Nano)},
			"before_source": {last.Source}, "before_key": {last.Key}}
		if v.Source != "" {
			next.Set("source", v.Source)
		}
		if v.Status != "" {
			next.Set("status", v.Status)
		}
		v.Next = template.URL(next.Encode())
	}
	d.render(w, r, http.StatusOK, "keys", "keys", "Keys", now, v)
}

// listKeys reads a page of the keys list in the order of the index on
// (expires_at, source, key) (migration 19), in a read-only transaction
// with enable_sort off: keys that share an expiry (a million adopted from
// a date column) are not read and sorted as a whole group, which the
// planner would otherwise choose over an index scan of poorly correlated
// rows (TestKeysOrderFromIndex). SET LOCAL ends with the transaction, so
// it holds through a transaction pooler too.
func (d *Dashboard) listKeys(ctx context.Context, kf keysForm, source, status string) ([]pgxdb.DashKeysRow, error) {
	var rows []pgxdb.DashKeysRow
	err := pgx.BeginTxFunc(ctx, d.cfg.Pool, pgx.TxOptions{AccessMode: pgx.ReadOnly}, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL enable_sort = off"); err != nil {
			return err
		}
		var err error
		rows, err = pgxdb.New(tx).DashKeys(ctx, pgxdb.DashKeysParams{Before: kf.Before, BeforeSource: kf.BeforeSource,
			BeforeKey: kf.BeforeKey, ScanLimit: keysScan, Source: source, Status: status, MaxRows: keysPage})
		return err
	})
	return rows, err
}
