package main

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestLayoutSmall runs the layout section at a tiny size: 2,600 keys over
// its 13 simulated months in each of the four layouts. It fails when
// retention removed a live row in any layout, when a layout's claim does
// not find a live row (one extended past retention, one of the 10-year
// source, or one in 50 of the rest), when a new key is not acquired or
// its duplicate not answered, or when a step of the upgrade prototype is
// refused. It measures nothing.
func TestLayoutSmall(t *testing.T) {
	defer func(k, c int) { layoutKeys, layoutClaims = k, c }(layoutKeys, layoutClaims)
	layoutKeys, layoutClaims = 2600, 50
	if err := benchLayout(context.Background(), nil, options{duration: 200 * time.Millisecond}, nil); err != nil {
		t.Fatal(err)
	}
	t.Log("\n" + layoutTable)
	for _, l := range layouts {
		if !strings.Contains(layoutTable, l.name) {
			t.Errorf("no row of %s in the report", l.name)
		}
	}
	if !strings.Contains(layoutTable, "0 of ") {
		t.Error("the upgrade rewrote a leaf")
	}
}
