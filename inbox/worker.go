package inbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
)

// Connection budget of a worker client (docs/inbox.md, "Sizing the
// pool"): River itself keeps one connection for LISTEN and needs one more
// for its own queries (fetching jobs, completing them, leadership,
// maintenance); each handler running holds its transaction's connection
// for as long as it runs, and needs one more, one query at a time, for
// its effects, its lease's keep-alive and recording. So a pool of
// MaxConns connections runs at most (MaxConns - RiverConns) / HandlerConns
// handlers at once without any of them waiting for a connection that only
// another waiting handler could free.
const (
	RiverConns   = 2
	HandlerConns = 2
)

// ErrPoolTooSmall: the pool cannot run even one handler (see
// WorkerCapacity).
var ErrPoolTooSmall = errors.New("inbox: the pool is too small for a worker")

// WorkerCapacity is how many handlers a worker client runs at once on a
// pool of maxConns connections: (maxConns - RiverConns) / HandlerConns.
// A pool for n handlers needs RiverConns + HandlerConns*n connections
// (pool_max_conns in the URL, or pgxpool.Config.MaxConns).
func WorkerCapacity(maxConns int32) int {
	return max(int(maxConns-RiverConns)/HandlerConns, 0)
}

// AddWorker registers the inbox worker on workers, for an application
// that runs its own River client: add the inbox queue (Queue) to that
// client's Queues as well, size its pool as WorkerCapacity says, and add
// RepairPeriodicJob to its PeriodicJobs (River enqueues periodic jobs on
// its leader only, which may be this client), or call Repair yourself.
// Register it even on a River client that does not
// work the inbox queue but shares its database: River's leader rescues
// stuck jobs of every queue, and discards a kind it has no worker for.
func (in *Inbox) AddWorker(workers *river.Workers) error {
	if !in.canWork() {
		return ErrNoHandler
	}
	if err := river.AddWorkerSafely(workers, &worker{in: in}); err != nil {
		return err
	}
	return river.AddWorkerSafely(workers, &repairWorker{in: in})
}

// NewWorkerClient returns a River client that works the inbox queue with
// maxWorkers handlers at once; call its Start and, on shutdown, Stop. base,
// when not nil, supplies the rest of River's configuration (its Workers
// and Queues are replaced).
//
// The pool decides what can run: maxWorkers 0 runs as many handlers as
// the pool serves (WorkerCapacity of its MaxConns, at most
// DefaultMaxWorkers), logged with the numbers; a maxWorkers the pool
// cannot serve is refused (ErrPoolTooSmall) with the exact pool_max_conns
// to set, never silently lowered; a pool too small for one handler is
// ErrPoolTooSmall too. Defaults that differ from River's, for the inbox:
// dead letters (discarded and cancelled jobs, which hold the payloads
// replay needs) are kept until replayed (retention -1), River's reindexer
// does not run (it needs to own River's tables, which a least-privilege
// worker does not), and Repair runs every Config.RepairEvery. A JobTimeout
// of -1 is refused: River never rescues a job with no timeout, so a
// crashed worker's job would stay running forever.
func (in *Inbox) NewWorkerClient(maxWorkers int, base *river.Config) (*river.Client[pgx.Tx], error) {
	if !in.canWork() {
		return nil, ErrNoHandler
	}
	if maxWorkers < 0 {
		return nil, fmt.Errorf("%w: maxWorkers %d must not be negative (0: as many as the pool serves)", ErrInvalidConfig, maxWorkers)
	}
	maxConns := in.cfg.Pool.Config().MaxConns
	capacity := WorkerCapacity(maxConns)
	if capacity < 1 {
		return nil, fmt.Errorf("%w: MaxConns is %d; a worker needs %d for River and %d per handler, so at least %d (pool_max_conns=%d in the URL)",
			ErrPoolTooSmall, maxConns, RiverConns, HandlerConns, RiverConns+HandlerConns, RiverConns+HandlerConns)
	}
	switch {
	case maxWorkers == 0:
		maxWorkers = min(capacity, DefaultMaxWorkers)
		in.cfg.Logger.Info(fmt.Sprintf("inbox: running %d handlers at once, what a pool of %d connections serves ((%d - %d for River) / %d per handler); for n at once, set pool_max_conns=%d+%d*n",
			maxWorkers, maxConns, maxConns, RiverConns, HandlerConns, RiverConns, HandlerConns))
	case maxWorkers > capacity:
		return nil, fmt.Errorf("%w: %d handlers at once need %d connections (%d for River and %d per handler), and the pool has %d: set pool_max_conns=%d in the database URL (or pgxpool.Config.MaxConns = %d), or ask for at most %d (0: as many as the pool serves)",
			ErrPoolTooSmall, maxWorkers, RiverConns+HandlerConns*maxWorkers, RiverConns, HandlerConns, maxConns,
			RiverConns+HandlerConns*maxWorkers, RiverConns+HandlerConns*maxWorkers, capacity)
	}
	cfg := river.Config{Logger: quiet(in.cfg.Logger)}
	if base != nil {
		cfg = *base
	}
	if cfg.JobTimeout < 0 {
		return nil, fmt.Errorf("%w: JobTimeout %v: River never rescues a job with no timeout, so a crashed worker's job would stay running forever; give a timeout longer than the handler's longest run", ErrInvalidConfig, cfg.JobTimeout)
	}
	cfg.Schema = in.cfg.Schema
	if cfg.DiscardedJobRetentionPeriod == 0 {
		cfg.DiscardedJobRetentionPeriod = -1
	}
	if cfg.CancelledJobRetentionPeriod == 0 {
		cfg.CancelledJobRetentionPeriod = -1
	}
	if cfg.ReindexerSchedule == nil {
		cfg.ReindexerSchedule = river.NeverSchedule()
	}
	cfg.Workers = river.NewWorkers()
	if err := in.AddWorker(cfg.Workers); err != nil {
		return nil, err
	}
	if pj := in.RepairPeriodicJob(); pj != nil {
		cfg.PeriodicJobs = append(append([]*river.PeriodicJob(nil), cfg.PeriodicJobs...), pj)
	}
	cfg.Queues = map[string]river.QueueConfig{in.cfg.Queue: {MaxWorkers: maxWorkers}}
	return river.NewClient(riverpgxv5.New(in.cfg.Pool), &cfg)
}

// RepairPeriodicJob is the periodic job that runs Repair every
// Config.RepairEvery (and once when its client starts leading), in the
// inbox queue; nil when RepairEvery is negative. NewWorkerClient's client
// has it. River enqueues periodic jobs on its leader only, and any River
// client on the same tables may lead: an application that runs a River
// client of its own (AddWorker, or next to NewWorkerClient's) adds it to
// that client's PeriodicJobs too, or Repair runs only where the
// application calls it whenever that client leads. Two clients that both
// have it do not run it twice: only the leader enqueues.
func (in *Inbox) RepairPeriodicJob() *river.PeriodicJob {
	if in.cfg.RepairEvery <= 0 {
		return nil
	}
	return river.NewPeriodicJob(
		river.PeriodicInterval(in.cfg.RepairEvery),
		func() (river.JobArgs, *river.InsertOpts) {
			return repairJob{}, &river.InsertOpts{Queue: in.cfg.Queue, MaxAttempts: 1}
		},
		&river.PeriodicJobOpts{RunOnStart: true})
}

// repairJob is the periodic job that runs Repair.
type repairJob struct{}

// Kind implements river.JobArgs.
func (repairJob) Kind() string { return Kind + ".repair" }

type repairWorker struct {
	river.WorkerDefaults[repairJob]
	in *Inbox
}

func (w *repairWorker) Work(ctx context.Context, _ *river.Job[repairJob]) error {
	_, err := w.in.Repair(ctx)
	return err
}
