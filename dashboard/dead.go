package dashboard

import (
	"context"
	"encoding/base64"
	"fmt"
	"html/template"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/inbox"
)

// deadPage is how many dead letters a page lists (the count is of all that
// match).
const deadPage = 200

type deadView struct {
	Inbox   bool
	Filter  filterForm
	Count   int64 // all that match
	Letters []inbox.DeadLetter
	Holds   []pgxdb.DashHoldsRow
}

// filterForm is the dead-letter filter as the page's form has it.
type filterForm struct {
	Source, Since, Until, Error string
}

func (f filterForm) values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{"source": f.Source, "since": f.Since, "until": f.Until, "error": f.Error} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

// parseFilter reads the filter of a dead-letter form (GET query or POST
// body). Times are RFC 3339, or a datetime-local value read as UTC.
func parseFilter(form url.Values) (filterForm, inbox.Filter, error) {
	ff := filterForm{Source: strings.TrimSpace(form.Get("source")), Since: strings.TrimSpace(form.Get("since")),
		Until: strings.TrimSpace(form.Get("until")), Error: form.Get("error")}
	f := inbox.Filter{Source: ff.Source, ErrorContains: ff.Error}
	if len(ff.Source) > 64 || len(ff.Error) > 200 {
		return ff, f, fmt.Errorf("a source is at most 64 bytes and the error text at most 200")
	}
	for _, v := range [][2]string{{"source", ff.Source}, {"error text", ff.Error}} {
		if err := checkText(v[0], v[1]); err != nil {
			return ff, f, err
		}
	}
	var err error
	if f.Since, err = parseWhen("since", ff.Since); err != nil {
		return ff, f, err
	}
	if f.Until, err = parseWhen("until", ff.Until); err != nil {
		return ff, f, err
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && !f.Until.After(f.Since) {
		return ff, f, fmt.Errorf("until (%s) must be after since (%s)", ff.Until, ff.Since)
	}
	return ff, f, nil
}

func parseWhen(name, s string) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%s %q is not a time: want 2026-11-24T13:00 (UTC) or RFC 3339", name, truncate(s, 40))
}

func (d *Dashboard) deadLetters(w http.ResponseWriter, r *http.Request) {
	ff, f, err := parseFilter(r.URL.Query())
	if err != nil {
		d.badRequest(w, r, "dead", "%v", err)
		return
	}
	p, cancel, ok := d.page(w, r)
	defer cancel()
	if !ok {
		return
	}
	ctx, q, now := p.ctx, p.q, p.now
	v := deadView{Inbox: d.cfg.Inbox != nil, Filter: ff}
	if v.Holds, err = q.DashHolds(ctx); err != nil {
		d.fail(w, r, "holds", err)
		return
	}
	if d.cfg.Inbox != nil {
		if v.Count, err = d.cfg.Inbox.CountDeadLetters(ctx, f); err != nil {
			d.fail(w, r, "dead letters", err)
			return
		}
		f.Limit = deadPage
		if v.Letters, err = d.cfg.Inbox.DeadLetters(ctx, f); err != nil {
			d.fail(w, r, "dead letters", err)
			return
		}
	}
	d.render(w, r, http.StatusOK, "dead", "dead", "Dead letters", now, v)
}

// keyRef is a dead letter named in a form: source and key, each base64url
// (a key may hold any character).
func keyRef(source, key string) string {
	return base64.RawURLEncoding.EncodeToString([]byte(source)) + "." + base64.RawURLEncoding.EncodeToString([]byte(key))
}

func parseKeyRef(s string) (source, key string, err error) {
	a, b, ok := strings.Cut(s, ".")
	src, err1 := base64.RawURLEncoding.DecodeString(a)
	k, err2 := base64.RawURLEncoding.DecodeString(b)
	if !ok || err1 != nil || err2 != nil || len(src) == 0 || len(k) == 0 {
		return "", "", fmt.Errorf("%q does not name a dead letter", truncate(s, 40))
	}
	for _, v := range [][2]string{{"its source", string(src)}, {"its key", string(k)}} {
		if err := checkText(v[0], v[1]); err != nil {
			return "", "", fmt.Errorf("%q does not name a dead letter: %w", truncate(s, 40), err)
		}
	}
	return string(src), string(k), nil
}

type confirmView struct {
	Filter   filterForm
	All      bool     // every dead letter the filter matches
	Refs     []string // or these
	Count    int64
	Letters  []inbox.DeadLetter
	Expected int64
}

type replayedView struct {
	Results []inbox.ReplayResult
	Tally   []tally
	Error   string
	Left    int64 // still matching the filter after the replay
	// Query is the filter as a query string, for the link back: built by
	// url.Values.Encode, so a template.URL (html/template would escape it
	// again as one query component).
	Query template.URL
}

type tally struct {
	Outcome string
	N       int
}

// replay is the one action: a POST of the dead-letter form. Without
// confirm=1 it is the dry run: what would be replayed, and how many, with
// a button that posts it again confirmed. Confirmed, it replays at most the
// number confirmed (a dead letter that arrived after the dry run waits for
// the next one) and says what it did with each.
func (d *Dashboard) replay(w http.ResponseWriter, r *http.Request) {
	if d.cfg.Inbox == nil {
		d.badRequest(w, r, "dead", "the inbox is not in use here (Config.Inbox is nil): nothing to replay")
		return
	}
	r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
	if err := r.ParseForm(); err != nil {
		d.badRequest(w, r, "dead", "the form could not be read: %v", err)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), d.cfg.QueryTimeout)
	defer cancel()
	ff, f, err := parseFilter(r.PostForm)
	if err != nil {
		d.badRequest(w, r, "dead", "%v", err)
		return
	}
	scope := r.PostForm.Get("scope")
	refs := r.PostForm["k"]
	switch {
	case scope == "all":
	case scope == "selected" && len(refs) > 0:
		if len(refs) > d.cfg.ReplayLimit {
			d.badRequest(w, r, "dead", "%d dead letters selected: at most %d in one replay", len(refs), d.cfg.ReplayLimit)
			return
		}
	case scope == "selected":
		d.badRequest(w, r, "dead", "no dead letter selected: tick some, or replay all that match")
		return
	default:
		d.badRequest(w, r, "dead", "scope %q is not all or selected", truncate(scope, 20))
		return
	}
	type ref struct{ source, key string }
	var keys []ref
	for _, s := range refs {
		src, key, err := parseKeyRef(s)
		if err != nil {
			d.badRequest(w, r, "dead", "%v", err)
			return
		}
		keys = append(keys, ref{src, key})
	}
	now := time.Now()
	if r.PostForm.Get("confirm") != "1" {
		cv := confirmView{Filter: ff, All: scope == "all", Refs: refs}
		if cv.All {
			if cv.Count, err = d.cfg.Inbox.CountDeadLetters(ctx, f); err != nil {
				d.fail(w, r, "dead letters", err)
				return
			}
			cv.Count = min(cv.Count, int64(d.cfg.ReplayLimit))
			f.Limit = deadPage
			if cv.Letters, err = d.cfg.Inbox.DeadLetters(ctx, f); err != nil {
				d.fail(w, r, "dead letters", err)
				return
			}
		} else {
			for _, k := range keys {
				dl, err := d.cfg.Inbox.DeadLetters(ctx, inbox.Filter{Source: k.source, Key: k.key, Limit: 1})
				if err != nil {
					d.fail(w, r, "dead letters", err)
					return
				}
				cv.Letters = append(cv.Letters, dl...)
			}
			cv.Count = int64(len(cv.Letters))
		}
		cv.Expected = cv.Count
		d.render(w, r, http.StatusOK, "confirm", "dead", "Replay: dry run", now, cv)
		return
	}

	// Confirmed. A replay may take longer than a page's query: it has a
	// bound of its own, a second per dead letter, at least a minute; and it
	// goes on when the browser goes away (the log says what it did).
	expected, err := strconv.ParseInt(r.PostForm.Get("expected"), 10, 64)
	if err != nil || expected < 0 || expected > int64(d.cfg.ReplayLimit) {
		d.badRequest(w, r, "dead", "expected %q is not the count the dry run showed", truncate(r.PostForm.Get("expected"), 20))
		return
	}
	rctx, rcancel := context.WithTimeout(context.WithoutCancel(r.Context()), max(time.Minute, time.Duration(expected)*time.Second))
	defer rcancel()
	var rv replayedView
	var res []inbox.ReplayResult
	if scope == "all" {
		f.Limit = int(expected)
		if expected > 0 {
			res, err = d.cfg.Inbox.Replay(rctx, f)
		}
	} else {
		for _, k := range keys {
			var one []inbox.ReplayResult
			one, err = d.cfg.Inbox.Replay(rctx, inbox.Filter{Source: k.source, Key: k.key, Limit: 1})
			res = append(res, one...)
			if err != nil {
				break
			}
		}
	}
	rv.Results = res
	if err != nil {
		rv.Error = "the replay stopped on an error (see the server's log); what is listed was done"
		d.log.LogAttrs(r.Context(), slog.LevelError, "dashboard: replay stopped", slog.Any("error", err))
	}
	counts := map[string]int{}
	for _, x := range res {
		counts[x.Outcome]++
	}
	for _, o := range []string{"replayed", "already processed", "in progress", "failed", "payload lost"} {
		if counts[o] > 0 {
			rv.Tally = append(rv.Tally, tally{o, counts[o]})
		}
	}
	attrs := []slog.Attr{slog.String("scope", scope), slog.Int64("confirmed", expected), slog.Int("went_through", len(res)),
		slog.String("remote", r.RemoteAddr), slog.String("user", r.Header.Get("Remote-User")),
		slog.String("filter", ff.values().Encode())}
	for _, t := range rv.Tally {
		attrs = append(attrs, slog.Int(strings.ReplaceAll(t.Outcome, " ", "_"), t.N))
	}
	d.log.LogAttrs(r.Context(), slog.LevelInfo, "dashboard: dead letters replayed", attrs...)
	if scope == "all" {
		f.Limit = 0
		if rv.Left, err = d.cfg.Inbox.CountDeadLetters(ctx, f); err != nil {
			rv.Left = -1
		}
	}
	rv.Query = template.URL(ff.values().Encode())
	d.render(w, r, http.StatusOK, "replayed", "dead", "Replay: done", now, rv)
}
