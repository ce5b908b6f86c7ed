package inbox

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/idemkit/idem/db/pgxdb"
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

// refuseCitus returns ErrCitus on a distributed installation. It asks
// through q (the pool, or AcceptTx's transaction: a second connection from
// a pool the caller's transaction may have exhausted could not be had)
// once, and again after a failed question: first Citus' catalog
// (CitusInstalled: no question of idem's, so it answers at every schema
// version and for every role), and only where Citus is installed
// idem.distributed() (migrate.Distributed asks the same two queries).
func (in *Inbox) refuseCitus(ctx context.Context, q pgxdb.DBTX) error {
	switch in.citus.v.Load() {
	case 1:
		return nil
	case 2:
		return ErrCitus
	}
	db := pgxdb.New(q)
	citus, err := db.CitusInstalled(ctx)
	distributed := false
	if err == nil && citus {
		distributed, err = db.Distributed(ctx)
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
