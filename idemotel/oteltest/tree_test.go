package oteltest_test

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// span is a recorded span, as the tests read it (from this process's
// recorder, or from a worker process's file).
type span struct {
	Name     string            `json:"name"`
	Kind     string            `json:"kind"`
	TraceID  string            `json:"trace_id"`
	SpanID   string            `json:"span_id"`
	ParentID string            `json:"parent_id,omitempty"`
	Attrs    map[string]string `json:"attrs,omitempty"`
	Events   []event           `json:"events,omitempty"`
	Links    []link            `json:"links,omitempty"`
	Status   string            `json:"status,omitempty"`
	Start    int64             `json:"start"`
}

type event struct {
	Name  string            `json:"name"`
	Attrs map[string]string `json:"attrs,omitempty"`
}

type link struct {
	TraceID string `json:"trace_id"`
	SpanID  string `json:"span_id"`
}

func attrMap(kvs []attribute.KeyValue) map[string]string {
	if len(kvs) == 0 {
		return nil
	}
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		m[string(kv.Key)] = kv.Value.Emit()
	}
	return m
}

func fromSDK(s sdktrace.ReadOnlySpan) span {
	out := span{Name: s.Name(), Kind: s.SpanKind().String(), TraceID: s.SpanContext().TraceID().String(),
		SpanID: s.SpanContext().SpanID().String(), Attrs: attrMap(s.Attributes()),
		Status: s.Status().Description, Start: s.StartTime().UnixNano()}
	if p := s.Parent(); p.IsValid() {
		out.ParentID = p.SpanID().String()
	}
	for _, e := range s.Events() {
		out.Events = append(out.Events, event{Name: e.Name, Attrs: attrMap(e.Attributes)})
	}
	for _, l := range s.Links() {
		out.Links = append(out.Links, link{TraceID: l.SpanContext.TraceID().String(), SpanID: l.SpanContext.SpanID().String()})
	}
	return out
}

func fromSDKs(ss []sdktrace.ReadOnlySpan) []span {
	out := make([]span, len(ss))
	for i, s := range ss {
		out[i] = fromSDK(s)
	}
	return out
}

// inTrace returns the spans of one trace.
func inTrace(spans []span, traceID string) []span {
	var out []span
	for _, s := range spans {
		if s.TraceID == traceID {
			out = append(out, s)
		}
	}
	return out
}

// shown are the attributes a rendered tree shows (the others are ids,
// times and what otelhttp and otelpgx add, left out so that the tree does
// not change from run to run).
var shown = []string{"idem.outcome", "idem.replayed", "idem.cached", "idem.effect.name", "idem.http.answer",
	"idem.inbox.outcome", "idem.attempt", "messaging.operation.type", "http.response.status_code", "error.type"}

// hidden are the spans a rendered tree leaves out: pgx's pool and
// connection housekeeping, which depends on which connection the pool
// hands out.
func hidden(s span) bool {
	return s.Name == "pool.acquire" || s.Name == "connect" || strings.HasPrefix(s.Name, "prepare")
}

// render draws the spans of one trace as an indented tree, children in
// start order, with their shown attributes, events and links.
func render(spans []span) string {
	byID := map[string]bool{}
	for _, s := range spans {
		byID[s.SpanID] = true
	}
	children := map[string][]span{}
	for _, s := range spans {
		p := s.ParentID
		if !byID[p] {
			p = ""
		}
		children[p] = append(children[p], s)
	}
	for _, c := range children {
		sort.SliceStable(c, func(i, j int) bool { return c[i].Start < c[j].Start })
	}
	var b strings.Builder
	// A span's PostgreSQL statements (otelpgx's client spans and theirs)
	// are one line: their names, each once, sorted. How many a wait
	// polls, and in which order, is the machine's timing.
	var statements func(id string, names map[string]bool)
	statements = func(id string, names map[string]bool) {
		for _, c := range children[id] {
			if !hidden(c) {
				names[c.Name] = true
			}
			statements(c.SpanID, names)
		}
	}
	var walk func(parent string, depth int)
	walk = func(parent string, depth int) {
		ind := strings.Repeat("  ", depth)
		names := map[string]bool{}
		for _, s := range children[parent] {
			if s.Attrs["db.system.name"] != "" && !hidden(s) {
				names[s.Name] = true
				statements(s.SpanID, names)
			}
		}
		if len(names) > 0 {
			list := make([]string, 0, len(names))
			for n := range names {
				list = append(list, n)
			}
			sort.Strings(list)
			fmt.Fprintf(&b, "%s%s (client)\n", ind, strings.Join(list, ", "))
		}
		for _, s := range children[parent] {
			if hidden(s) || s.Attrs["db.system.name"] != "" {
				continue
			}
			fmt.Fprintf(&b, "%s%s (%s)%s\n", ind, s.Name, strings.ToLower(strings.TrimPrefix(s.Kind, "SpanKind")), attrText(s.Attrs))
			for _, e := range s.Events {
				fmt.Fprintf(&b, "%s  · event %s%s\n", ind, e.Name, attrText(e.Attrs))
			}
			for range s.Links {
				fmt.Fprintf(&b, "%s  · link to the accepting request's trace\n", ind)
			}
			walk(s.SpanID, depth+1)
		}
	}
	walk("", 0)
	return b.String()
}

func attrText(m map[string]string) string {
	var parts []string
	for _, k := range shown {
		if v, ok := m[k]; ok {
			parts = append(parts, k+"="+v)
		}
	}
	for k, v := range m { // an event's own attributes
		if strings.HasPrefix(k, "idem.http.") || k == "idem.wait.ms" {
			if !slices.Contains(shown, k) {
				if k == "idem.wait.ms" {
					v = "…"
				}
				parts = append(parts, k+"="+v)
			}
		}
	}
	sort.Strings(parts[min(len(parts), countShown(m)):])
	if len(parts) == 0 {
		return ""
	}
	return " " + strings.Join(parts, " ")
}

func countShown(m map[string]string) int {
	n := 0
	for _, k := range shown {
		if _, ok := m[k]; ok {
			n++
		}
	}
	return n
}

// parentOf returns the span whose id is s's parent.
func parentOf(spans []span, s span) (span, bool) {
	for _, p := range spans {
		if p.SpanID == s.ParentID {
			return p, true
		}
	}
	return span{}, false
}

// find returns the spans named name (a prefix ending in a space matches
// names that start with it).
func find(spans []span, name string) []span {
	var out []span
	for _, s := range spans {
		if s.Name == name || strings.HasSuffix(name, " ") && strings.HasPrefix(s.Name, name) {
			out = append(out, s)
		}
	}
	return out
}

var _ = trace.SpanKindServer
