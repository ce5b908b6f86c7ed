// Package reliability holds the fault-injection, load and security tests
// (docs/reliability.md). They run in CI at the sizes the issue sets; with
// IDEM_SOAK=1 they run longer and bigger (make soak).
package reliability

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helper())
	}
	testdb.Main(m)
}

// soak reports whether the long variant was asked for.
func soak() bool { return os.Getenv("IDEM_SOAK") != "" }

// scale returns ci normally and soakN under IDEM_SOAK.
func scale(ci, soakN int) int {
	if soak() {
		return soakN
	}
	return ci
}

const helperEnv = "IDEM_RELIABILITY_HELPER"

// helper is the crash test's worker process: it acquires keys, says so,
// and hangs until it is killed.
func helper() int {
	ctx := context.Background()
	n, _ := strconv.Atoi(os.Getenv("HELPER_KEYS"))
	lease, _ := time.ParseDuration(os.Getenv("HELPER_LEASE"))
	pool := mustPool(os.Getenv("HELPER_URL"))
	c, err := idem.New(pool, nil)
	if err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		return 1
	}
	for i := range n {
		cl, err := c.Claim(ctx, "crash", fmt.Sprintf("job-%05d", i), idem.WithLease(lease))
		if err != nil || cl.Outcome != idem.Acquired {
			fmt.Fprintf(os.Stderr, "helper: claim %d: %+v %v\n", i, cl, err)
			return 1
		}
	}
	fmt.Println("acquired", n)
	select {} // "working" until SIGKILL
}
