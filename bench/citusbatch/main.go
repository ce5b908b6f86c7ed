// Command citusbatch claims new keys for a while through idem's Go API,
// one key a call (Claim) or in batches (ClaimBatch), from several clients,
// and prints the keys claimed per second: the batch path of bench/citus.sh
// (docs/citus.md), which pgbench cannot drive (a batch on Citus is a call
// per node, grouped by idem.citus_batch_routes).
//
//	go run ./bench/citusbatch -database-url postgres://postgres@127.0.0.1:9700/idem_w2 -batch 100
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
)

func main() {
	url := flag.String("database-url", "", "the database (a Citus coordinator's, or a single PostgreSQL)")
	batch := flag.Int("batch", 100, "keys per ClaimBatch call; 1: Claim, one key a call")
	clients := flag.Int("clients", 8, "concurrent clients")
	duration := flag.Duration("duration", 10*time.Second, "how long to claim, and count, after the warm-up")
	warmup := flag.Duration("warmup", 0, "claim this long first without counting (the servers' plan caches fill)")
	flag.Parse()
	if *url == "" || *batch < 1 || *batch > idem.MaxBatch || *clients < 1 {
		fmt.Fprintln(os.Stderr, "citusbatch: -database-url is required; -batch 1 to 1000; -clients at least 1")
		os.Exit(2)
	}
	if err := run(*url, *batch, *clients, *warmup, *duration); err != nil {
		fmt.Fprintln(os.Stderr, "citusbatch:", err)
		os.Exit(1)
	}
}

func run(url string, batch, clients int, warmup, duration time.Duration) error {
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return err
	}
	cfg.MaxConns = int32(clients)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer pool.Close()
	c, err := idem.New(pool, nil)
	if err != nil {
		return err
	}
	run := strconv.FormatInt(time.Now().UnixNano(), 36)
	var claimed atomic.Int64
	var first error
	var once sync.Once
	var wg sync.WaitGroup
	start := time.Now().Add(warmup)
	stop := start.Add(duration)
	for g := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			items := make([]idem.BatchItem, batch)
			for n := 0; time.Now().Before(stop); n++ {
				prefix := run + "-" + strconv.Itoa(g) + "-" + strconv.Itoa(n) + "-"
				var err error
				if batch == 1 {
					var cl *idem.Claim
					cl, err = c.Claim(ctx, "pgbench", prefix)
					if err == nil && cl.Outcome != idem.Acquired {
						err = fmt.Errorf("a new key answered %s", cl.Outcome)
					}
				} else {
					for i := range items {
						items[i] = idem.BatchItem{Key: prefix + strconv.Itoa(i)}
					}
					var cls []*idem.Claim
					cls, err = c.ClaimBatch(ctx, "pgbench", items)
					for _, cl := range cls {
						if err == nil && cl.Outcome != idem.Acquired {
							err = fmt.Errorf("a new key answered %s", cl.Outcome)
						}
					}
				}
				if err != nil {
					once.Do(func() { first = err })
					return
				}
				if time.Now().After(start) {
					claimed.Add(int64(batch))
				}
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return first
	}
	fmt.Printf("keys=%d keys/s=%d\n", claimed.Load(), int64(float64(claimed.Load())/duration.Seconds()))
	return nil
}
