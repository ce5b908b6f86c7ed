package idem_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testdb"
)

// FuzzStorable feeds any bytes, as a result and as an error text, through
// each path that stores them: CheckResult agrees with PostgreSQL's jsonb
// (refuses exactly what the server refuses, size aside); Do on a pool and
// Do inside the caller's transaction complete the key (with the result, or
// without it and ErrResultNotStored) and the transaction commits; a
// failure with that text is recorded (permanent: later deliveries answer
// Failed). Every key ends completed or failed, and no work runs twice. The
// seeds hold NUL, invalid UTF-8, lone surrogate escapes, numbers at
// numeric's bounds and results at and over the 1 MiB limit. CI runs it
// briefly (.ci/run); `make fuzz FUZZTIME=5m` runs it longer.
func FuzzStorable(f *testing.F) {
	for _, s := range [][]byte{[]byte(`{"a":1}`), []byte(`"\u0000"`), []byte("\"\xff\""), []byte("a\x00b"),
		[]byte(`"\ud800"`), []byte(`"\udc00"`), []byte(`"\ud83d\ude00"`), []byte(`["\ud800\u0041"]`),
		[]byte(`1e131071`), []byte(`1e131072`), []byte(`1e-16383`), []byte(`0e-16384`), []byte(`-0.0e0`),
		[]byte(`{"a":`), []byte(""), []byte("null"), []byte(`"é"`), []byte("\"\xc3\"")} {
		f.Add(s, uint16(0))
	}
	for _, s := range [][]byte{[]byte(`{"a":1}`), []byte(`"\u0000"`), []byte("\xff")} {
		for _, size := range []uint16{1, 5*90 + 1, 5*47 + 2, 5*49 + 2} { // under and over each limit
			f.Add(s, size)
		}
	}
	pool := testdb.Pool(f, testdb.New(f), 4)
	c := testdb.Client(f, pool, nil)
	ctx := context.Background()
	var n atomic.Int64
	// size, one time in five, pads the result to about 1 MiB (at and around
	// the limit: 1 MiB - 48 + size/5%97 bytes of text), and one time in
	// five the error text to about 8 KiB, where it is cut: the inputs stay
	// small for the fuzzer.
	f.Fuzz(func(t *testing.T, b []byte, size uint16) {
		sum := sha256.Sum256(b)
		key := fmt.Sprintf("%d-%s", n.Add(1), hex.EncodeToString(sum[:8])) // an input may come again
		text := string(b)
		if size%5 == 2 {
			text = strings.Repeat("é", (idem.MaxTextBytes-48+int(size/5%97))/2) + text
		}

		// CheckResult against the server.
		goErr := idem.CheckResult(b)
		var out string
		pgErr := pool.QueryRow(ctx, `SELECT $1::text::jsonb::text`, string(b)).Scan(&out)
		if goErr == nil && pgErr != nil {
			t.Fatalf("%q: CheckResult accepts, PostgreSQL refuses: %v", b, pgErr)
		}
		if goErr != nil && pgErr == nil && len(b) > 0 {
			t.Fatalf("%q: CheckResult refuses (%v), PostgreSQL accepts", b, goErr)
		}
		if size%5 == 1 {
			pad := 1<<20 - 48 + int(size/5%97) - len(b)
			if pad > 0 {
				b = append([]byte(`["`+strings.Repeat("x", pad)+`", `), append(b, ']')...)
			}
		}

		runs := 0
		work := func(result any, err error) func(context.Context) (any, error) {
			return func(context.Context) (any, error) { runs++; return result, err }
		}
		result := json.RawMessage(b)
		if b == nil {
			result = json.RawMessage{}
		}
		done := func(what, source string, res *idem.Result, err error) {
			t.Helper()
			if err != nil && !errors.Is(err, idem.ErrResultNotStored) {
				t.Fatalf("%s %q: %v", what, b, err)
			}
			cl, cerr := c.Claim(ctx, source, key)
			if cerr != nil || cl.Outcome != idem.Completed {
				t.Fatalf("%s %q: after: %+v %v", what, b, cl, cerr)
			}
		}
		// Do on the pool.
		res, err := c.Do(ctx, "fz-pool", key, work(result, nil))
		done("pool", "fz-pool", res, err)
		// Do in the caller's transaction, which must commit.
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			res, err = c.WithTx(tx).Do(ctx, "fz-tx", key, work(result, nil))
			return nil
		}); err != nil {
			t.Fatalf("tx %q: commit: %v (Do: %v)", b, err, res)
		}
		done("tx", "fz-tx", res, err)
		// A permanent failure whose text is b.
		if _, err := c.Do(ctx, "fz-fail", key, work(nil, idem.Permanent(errors.New(text)))); err == nil || err.Error() != text {
			t.Fatalf("fail %q: %v", b, err)
		}
		if cl, err := c.Claim(ctx, "fz-fail", key); err != nil || cl.Outcome != idem.Failed {
			t.Fatalf("fail %q: after: %+v %v", b, cl, err)
		}
		// Redeliveries run nothing.
		before := runs
		_, _ = c.Do(ctx, "fz-pool", key, work(result, nil))
		_, _ = c.Do(ctx, "fz-fail", key, work(nil, nil))
		if runs != before || before != 3 {
			t.Fatalf("%q: the work ran %d times, then %d more", b, before, runs-before)
		}
	})
}
