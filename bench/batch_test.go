package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pgcluster"
)

// TestBatchSectionSmoke runs the batch section once, tiny (batches of 10,
// one client, 50 ms per side, one round, the fsync-off server alone): every
// path of it works and fills its rows. It measures nothing.
func TestBatchSectionSmoke(t *testing.T) {
	t.Chdir("..") // the section reads bench/pgbench/ from the repository root
	ctx := context.Background()
	c, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	batchSizes = []int{10}
	o := options{rounds: 1, duration: 50 * time.Millisecond, clients: []int{1}}
	tab := &v2table{}
	if err := benchBatchOn(ctx, server{"smoke", c.URL("postgres"), c.BinDir}, o, tab); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	tab.servers = []string{"smoke"}
	tab.write(&b)
	for _, want := range []string{"SQL: idem.claim_batch vs raw", "vs idem.claim, per key", "hand-written batch pattern: duplicates, in the caller's transaction",
		"per-message pattern: new keys, autocommit", "DoBatch vs Do per key"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no row %q in\n%s", want, b.String())
		}
	}
}

// TestCeilingSectionSmoke checks that every experiment of ceiling/ still
// applies to the schema as migrated and answers a batch of new keys or
// duplicates the way DoBatch expects, then runs the section once, tiny (one
// client, 50 ms per side, one round) for its rows. It measures nothing.
func TestCeilingSectionSmoke(t *testing.T) {
	t.Chdir("..")
	ctx := context.Background()
	c, err := pgcluster.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Stop()
	srv := server{"smoke", c.URL("postgres"), c.BinDir}
	for _, x := range ceilingExperiments {
		t.Run(x.name, func(t *testing.T) {
			pool, client, err := ceilingDatabase(ctx, srv, "idem_smoke_ceiling", x.files)
			if err != nil {
				t.Fatal(err)
			}
			defer pool.Close()
			res, err := client.DoBatch(ctx, "batch", batchItems(batchKeys(ceilingBatch, x.dup)), batchWork)
			if err != nil {
				t.Fatal(err)
			}
			for i, r := range res {
				if r.Err != nil || r.Replayed != x.dup || string(r.Result.Result) != string(batchResult) {
					t.Fatalf("item %d: err %v, replayed %v, result %s", i, r.Err, r.Replayed, r.Result.Result)
				}
			}
		})
	}
	o := options{rounds: 1, duration: 50 * time.Millisecond, clients: []int{1}}
	tab, floor := &v2table{}, &v2table{}
	if err := benchCeilingOn(ctx, srv, o, tab, floor); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	tab.servers, floor.servers = []string{"smoke"}, []string{"smoke"}
	tab.write(&b)
	for _, x := range ceilingExperiments {
		for _, want := range []string{x.name + ", vs as shipped", x.name + ", vs the hand-written batch pattern"} {
			if !strings.Contains(b.String(), want) {
				t.Errorf("no row %q in\n%s", want, b.String())
			}
		}
	}
	b.Reset()
	floor.write(&b)
	for _, want := range []string{"idem.claim vs the minimal claim: new keys, 1 clients", "idem.claim vs the minimal claim: duplicates",
		"vs the minimal claim and completion: new keys", "the minimal claim vs raw INSERT", "the minimal claim vs the raw conflict path",
		"the minimal claim and completion vs the hand-written insert-first pattern"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("no row %q in\n%s", want, b.String())
		}
	}
}
