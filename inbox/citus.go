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
// Accept, AcceptTx, the worker, Replay and Repair return it; nothing is
// written.
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

// refuseCitus returns ErrCitus on a distributed installation. It asks
// through q once, and again after a failed question: first whether Citus
// is installed in the database at all (its catalog pg_dist_partition,
// which every role may look up: no question of idem's, so it answers at
// every schema version and for every role); only where it is, whether
// idem.processed_events is distributed (idem.distributed(), migration 11,
// which the application's and the maintainer's roles may ask since
// migration 12).
func (in *Inbox) refuseCitus(ctx context.Context, q querier) error {
	switch in.citus.v.Load() {
	case 1:
		return nil
	case 2:
		return ErrCitus
	}
	var citus, distributed bool
	err := q.QueryRow(ctx, `SELECT to_regclass('pg_catalog.pg_dist_partition') IS NOT NULL AND to_regprocedure('idem.distributed()') IS NOT NULL`).Scan(&citus)
	if err == nil && citus {
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
