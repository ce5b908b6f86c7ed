package dashboard

import (
	"net/http"
	"net/url"
	"slices"
	"time"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/db/pgxdb"
)

// Key listing: a page of keysPage rows among the keysScan rows that expire
// last (before the cursor), read on the expires_at index.
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
	Next                string // the next page's query, "" on the last
}

func (d *Dashboard) keys(w http.ResponseWriter, r *http.Request) {
	form := r.URL.Query()
	v := keysView{Source: form.Get("source"), Key: form.Get("key"), Status: form.Get("status"), Statuses: statuses,
		ShowResults: d.cfg.ShowResults, Scan: keysScan}
	if v.Status != "" && !slices.Contains(statuses, v.Status) {
		d.badRequest(w, r, "keys", "status %q is not one of %v", truncate(v.Status, 40), statuses)
		return
	}
	if len(v.Source) > 64 || len(v.Key) > 512 {
		d.badRequest(w, r, "keys", "a source is at most 64 bytes and a key at most 512")
		return
	}
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
		if v.Source == "" {
			d.badRequest(w, r, "keys", "a key lookup needs its source")
			return
		}
		v.Lookup = true
		v.Found, err = q.DashKey(ctx, pgxdb.DashKeyParams{Source: v.Source, Key: v.Key, WithResult: d.cfg.ShowResults})
		if err != nil {
			d.fail(w, r, "the key", err)
			return
		}
		d.render(w, r, http.StatusOK, "keys", "keys", "Keys", now, v)
		return
	}
	before := pgtype.Timestamptz{InfinityModifier: pgtype.Infinity, Valid: true}
	if b := form.Get("before"); b != "" {
		t, err := time.Parse(time.RFC3339Nano, b)
		if err != nil {
			d.badRequest(w, r, "keys", "before %q is not an RFC 3339 time", truncate(b, 40))
			return
		}
		before = pgtype.Timestamptz{Time: t, Valid: true}
	}
	v.List, err = q.DashKeys(ctx, pgxdb.DashKeysParams{Before: before, ScanLimit: keysScan, Source: v.Source,
		Status: v.Status, MaxRows: keysPage})
	if err != nil {
		d.fail(w, r, "keys", err)
		return
	}
	if len(v.List) == keysPage {
		next := url.Values{"before": {v.List[len(v.List)-1].ExpiresAt.Time.Format(time.RFC3339Nano)}}
		if v.Source != "" {
			next.Set("source", v.Source)
		}
		if v.Status != "" {
			next.Set("status", v.Status)
		}
		v.Next = next.Encode()
	}
	d.render(w, r, http.StatusOK, "keys", "keys", "Keys", now, v)
}
