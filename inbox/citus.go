package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
)

// ErrCitus: idem is distributed (Citus, idemctl migrate up --citus) and
// the inbox does not run there yet: its queue functions would take a key's
// lock on the coordinator, where the key's claims do not (docs/citus.md).
// Accept, the worker and Replay return it; nothing is written.
var ErrCitus = errors.New("inbox: idem is distributed (Citus), where the inbox does not run yet (docs/citus.md)")

// citusState caches what idem.distributed() answered for the inbox's
// database: 0 not asked yet (or the question failed), 1 no, 2 yes.
type citusState struct{ v atomic.Int32 }

// querier is what refuseCitus asks through: the pool, or the caller's
// transaction (AcceptTx: a second connection from a pool the caller's
// transaction may have exhausted could not be had).
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// refuseCitus returns ErrCitus on a distributed installation. It asks the
// database through q once (idem.distributed(), migration 11, which the
// application's and maintainer's roles may ask since migration 12; before
// 11 idem cannot be distributed), and again after a failed question.
func (in *Inbox) refuseCitus(ctx context.Context, q querier) error {
	switch in.citus.v.Load() {
	case 1:
		return nil
	case 2:
		return ErrCitus
	}
	var exists, distributed bool
	err := q.QueryRow(ctx, `SELECT to_regprocedure('idem.distributed()') IS NOT NULL`).Scan(&exists)
	if err == nil && exists {
		err = q.QueryRow(ctx, `SELECT idem.distributed()`).Scan(&distributed)
	}
	if err != nil {
		return fmt.Errorf("inbox: ask whether idem is distributed: %w", err)
	}
	if distributed {
		in.citus.v.Store(2)
		return ErrCitus
	}
	in.citus.v.Store(1)
	return nil
}
