package dashboard

import (
	"fmt"
	"html/template"
	"math"
	"strings"
	"time"
)

// bucket is one interval of a chart: claims (acquisitions + duplicates)
// and duplicates in it.
type bucket struct {
	Start      time.Time
	Claims     int64
	Duplicates int64
}

// rate is the bucket's duplicate rate, NaN without claims.
func (b bucket) rate() float64 {
	if b.Claims == 0 {
		return math.NaN()
	}
	return float64(b.Duplicates) / float64(b.Claims)
}

// Chart geometry, in SVG user units.
const (
	chartW, chartH         = 560.0, 150.0
	padL, padR, padT, padB = 44.0, 54.0, 10.0, 22.0
)

// chart draws buckets as an SVG: claims per bucket as grey bars (right
// axis), the duplicate rate as a line (left axis, 0 to 100%, or less when
// every rate is low), and the alert threshold as a dashed red line. It
// needs no script; what it shows is also in the page's table.
func chart(title string, buckets []bucket, step time.Duration, threshold float64, startLabel string) template.HTML {
	plotW, plotH := chartW-padL-padR, chartH-padT-padB
	maxRate := threshold * 1.5
	var maxClaims int64 = 1
	for _, b := range buckets {
		if r := b.rate(); !math.IsNaN(r) && r > maxRate {
			maxRate = r
		}
		maxClaims = max(maxClaims, b.Claims)
	}
	maxRate = math.Min(1, niceCeil(maxRate))
	n := float64(len(buckets))
	x := func(i float64) float64 { return padL + plotW*i/n }
	yRate := func(r float64) float64 { return padT + plotH*(1-r/maxRate) }
	yClaims := func(c int64) float64 { return padT + plotH*(1-float64(c)/float64(maxClaims)) }

	var s strings.Builder
	fmt.Fprintf(&s, `<svg class="chart" viewBox="0 0 %.0f %.0f" role="img" aria-label="%s" xmlns="http://www.w3.org/2000/svg">`,
		chartW, chartH, template.HTMLEscapeString(title))
	fmt.Fprintf(&s, `<title>%s</title>`, template.HTMLEscapeString(title))
	// Grid and axes.
	for _, f := range []float64{0, 0.5, 1} {
		y := padT + plotH*(1-f)
		fmt.Fprintf(&s, `<line class="grid" x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f"/>`, padL, padL+plotW, y, y)
		fmt.Fprintf(&s, `<text class="axis" x="%.1f" y="%.1f" text-anchor="end">%s</text>`, padL-4, y+4, formatPct(maxRate*f))
		fmt.Fprintf(&s, `<text class="axis claims" x="%.1f" y="%.1f">%s</text>`, padL+plotW+4, y+4, formatInt(int64(float64(maxClaims)*f)))
	}
	// Claims per bucket.
	bw := math.Max(plotW/n-1, 1)
	for i, b := range buckets {
		if b.Claims == 0 {
			continue
		}
		y := yClaims(b.Claims)
		fmt.Fprintf(&s, `<rect class="bar" x="%.1f" y="%.1f" width="%.1f" height="%.1f"><title>%s: %s claims, %s duplicates</title></rect>`,
			x(float64(i))+0.5, y, bw, padT+plotH-y, formatTime(b.Start), formatInt(b.Claims), formatInt(b.Duplicates))
	}
	// The threshold.
	if threshold <= maxRate {
		y := yRate(threshold)
		fmt.Fprintf(&s, `<line class="threshold" x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f"/>`, padL, padL+plotW, y, y)
		fmt.Fprintf(&s, `<text class="threshold-label" x="%.1f" y="%.1f" text-anchor="end">alert %s</text>`, padL+plotW-2, y-3, formatPct(threshold))
	}
	// The duplicate rate, broken where a bucket had no claims.
	var pts []string
	flush := func() {
		switch len(pts) {
		case 0:
		case 1:
			var px, py float64
			fmt.Sscanf(pts[0], "%f,%f", &px, &py)
			fmt.Fprintf(&s, `<circle class="rate" cx="%.1f" cy="%.1f" r="2"/>`, px, py)
		default:
			fmt.Fprintf(&s, `<polyline class="rate" points="%s"/>`, strings.Join(pts, " "))
		}
		pts = pts[:0]
	}
	for i, b := range buckets {
		r := b.rate()
		if math.IsNaN(r) {
			flush()
			continue
		}
		pts = append(pts, fmt.Sprintf("%.1f,%.1f", x(float64(i)+0.5), yRate(r)))
	}
	flush()
	fmt.Fprintf(&s, `<text class="axis" x="%.1f" y="%.1f">%s</text>`, padL, chartH-6, template.HTMLEscapeString(startLabel))
	fmt.Fprintf(&s, `<text class="axis" x="%.1f" y="%.1f" text-anchor="end">now (%s buckets)</text>`, padL+plotW, chartH-6, formatDuration(step))
	s.WriteString(`</svg>`)
	return template.HTML(s.String())
}

// niceCeil rounds a rate up to 5%, 10%, 20%, 25%, 50% or 100%.
func niceCeil(r float64) float64 {
	for _, c := range []float64{0.05, 0.1, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1} {
		if r <= c {
			return c
		}
	}
	return 1
}
