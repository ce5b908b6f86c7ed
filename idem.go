// Package idem makes at-least-once deliveries harmless: claim a key, do the
// work, complete it; a duplicate delivery gets the stored result, or is told
// the first one is still in flight, and never runs the work twice.
//
// The protocol lives in PostgreSQL (schema idem, functions idem.claim,
// idem.complete, idem.fail, idem.extend; see docs/design.md). This package
// is a small typed layer over it that works with a *pgxpool.Pool, a pgx.Tx
// (claim inside your own transaction for exactly-once database effects) and,
// through database/sql, a *sql.DB or *sql.Tx.
//
//	c, err := idem.New(pool, nil)
//	if err != nil {
//		return err
//	}
//	res, err := c.Do(ctx, "stripe", event.ID, func(ctx context.Context) (any, error) {
//		return chargeCustomer(ctx, event)
//	})
package idem

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/sqlstate"
)

// Outcome is what idem.claim decided.
type Outcome string

const (
	// Acquired: the caller owns the work and must complete or fail it with
	// Claim.Token before Claim.LeaseExpiresAt (or extend the lease).
	Acquired Outcome = "acquired"
	// Completed: the work was done before; Claim.Result holds its result.
	Completed Outcome = "completed"
	// InProgress: another worker holds a live lease; retry after
	// Claim.LeaseExpiresAt.
	InProgress Outcome = "in_progress"
	// Mismatch: the key was used with a different request fingerprint.
	Mismatch Outcome = "mismatch"
	// Failed: a permanent failure was recorded; Claim.Error says why.
	Failed Outcome = "failed"
)

// Claim is the answer of idem.claim for one key.
type Claim struct {
	Outcome        Outcome
	Source, Key    string
	Token          int64           // fencing token; non-zero only when Acquired
	Attempt        int             // 1 for the first acquisition, +1 per re-acquisition
	LeaseExpiresAt time.Time       // Acquired and InProgress: when the lease ends
	Result         json.RawMessage // Completed: the stored result, byte for byte as stored
	Error          string          // Failed: the recorded error; Acquired: the previous attempt's error, if any
	FirstSeen      time.Time
	ExpiresAt      time.Time // when the key's retention ends
	// LeaseRemaining, by the database's clock: Acquired, the lease granted;
	// InProgress, what is left of the holder's lease (0 when unknown, as
	// for a claim still inside another open transaction).
	LeaseRemaining time.Duration
}

// Config configures a Client. The zero value (or nil) is valid; every
// field's zero value means its documented default.
type Config struct {
	// Logger receives warnings (a failed release after a panic, a lost
	// lease, a retried record). Default: slog.Default().
	Logger *slog.Logger
	// HeartbeatFraction: Do extends the lease every lease*fraction while the
	// work runs, when the client is backed by a pool, timed by the local
	// monotonic clock from the lease length the database granted (never by
	// comparing the two clocks). Default (0): 1/3. Must be below 1; a
	// negative value turns the heartbeat off.
	HeartbeatFraction float64
	// RecordTimeout bounds how long Do keeps trying to record the work's
	// outcome (complete, or fail) after the work returned. Recording is
	// detached from the caller's context, so a caller that gave up (a
	// sender that hung up) does not leave the key processing, and transient
	// errors (lost connections, serialization failures, pooler errors) are
	// retried with jittered backoff until then. Default (0): 30 seconds.
	// Must not be negative.
	RecordTimeout time.Duration
	// LockWait bounds how long a claim waits for another claim of the same
	// key whose transaction is still open; past it the claim answers
	// InProgress. Default (0): the database's default, 5 seconds. A
	// negative value answers at once. WithLockWait overrides it per claim.
	LockWait time.Duration
	// QueryExecMode fixes the pgx execution mode of the protocol's
	// statements (New, and NewSQL over pgx's stdlib driver, which takes
	// the mode as pgx does). Default (0): adaptive. The pool's own mode
	// (pgx's statement cache, unless the pool says otherwise) until the
	// server answers that a prepared statement is missing or already
	// exists (SQLSTATE 26000 or 42P05: a transaction pooler, such as
	// PgBouncer before 1.21, handed the connection another backend); from
	// then on this client, and those WithTx derives from it, use
	// pgx.QueryExecModeExec, which needs no named prepared statement, and
	// the refused statement is sent again (inside a transaction, that one
	// transaction fails and the caller retries it). So PgBouncer's
	// transaction pooling works with pgx's default pool configuration,
	// while a direct connection keeps the statement cache, about a quarter
	// faster per claim. Set pgx.QueryExecModeExec to start in exec mode.
	QueryExecMode pgx.QueryExecMode
	// Observer is told the source, outcome (or error) and duration of
	// every claim, for metrics (package idemprom); it is reported through
	// the same seam as Tracer. Default: none.
	Observer Observer
	// Tracer is told when each operation starts and ends (claims, Do, its
	// work, effects, recording, waits, cache answers, and the operations
	// of idemhttp and the inbox over this client), for tracing and metrics
	// (package idemotel: OpenTelemetry). Clients derived by WithTx and
	// WithSQLTx share it. Default: none.
	Tracer Tracer
	// Cache, when set, keeps completed outcomes in this process (a bounded
	// LRU, CacheConfig), so that a repeat duplicate is answered without a
	// round trip. It serves only Completed answers, for the fingerprint
	// they were read with, for at most MaxAge and never near the end of
	// the key's retention; every other answer (in progress, failed,
	// mismatch, a first delivery) comes from the database. An operator's
	// idem.release (idemctl release) is heard by every process: the client
	// listens on channel idem_released on one connection of its own, and
	// the cache answers only while that listener was heard from within
	// 1.5 s (it pings when quiet); a release takes effect ReleaseGrace
	// after its commit, in the database and every cache at once, so once
	// idemctl release has returned no cache answers for the key. Where
	// LISTEN gets nothing (a transaction pooler), the cache never answers.
	// Rows deleted by hand are not heard: use idem.release. New only, over
	// a *pgxpool.Pool; call Client.Close to stop the listener. Clients
	// from WithTx answer from the same cache, and fill it only with a
	// completion another transaction committed (on a miss that answered
	// Completed, one more query checks that the caller's transaction has
	// written nothing and reads at READ COMMITTED). Default: none.
	Cache *CacheConfig
	// EffectAcquireWait bounds how long an effect's claim waits for a free
	// connection of the pool. An event whose work runs in the caller's
	// transaction holds a connection while each of its effects needs
	// another of the same pool, so with as many such events in flight as
	// the pool has connections none would ever get one; past this wait
	// the effect fails with ErrNoConnection (a *NoConnectionError naming
	// the pool's size) and its event's work with it, which frees the
	// transaction's connection. Default (0): 5 seconds; negative: no bound
	// (the pool's own wait, until ctx ends).
	EffectAcquireWait time.Duration
}

// Defaults of Config.
const (
	DefaultHeartbeatFraction = 1.0 / 3
	DefaultRecordTimeout     = 30 * time.Second
)

// ErrInvalidConfig: New or NewSQL was given no database, or a Config field
// out of range (wrapped, naming the field): they return it, and no Client.
var ErrInvalidConfig = errors.New("idem: invalid config")

// Validate reports a Config field out of range, as ErrInvalidConfig.
func (c *Config) Validate() error {
	if c == nil {
		return nil
	}
	switch {
	case c.HeartbeatFraction >= 1 || math.IsNaN(c.HeartbeatFraction):
		return fmt.Errorf("%w: HeartbeatFraction %v must be below 1 (0 for the default 1/3, negative for no heartbeat)", ErrInvalidConfig, c.HeartbeatFraction)
	case c.RecordTimeout < 0:
		return fmt.Errorf("%w: RecordTimeout %v must not be negative (0 for the default %v)", ErrInvalidConfig, c.RecordTimeout, DefaultRecordTimeout)
	case c.EffectAcquireWait > time.Hour:
		return fmt.Errorf("%w: EffectAcquireWait %v is over 1 hour (0 for the default %v, negative for no bound)", ErrInvalidConfig, c.EffectAcquireWait, DefaultEffectAcquireWait)
	case c.LockWait > time.Hour:
		return fmt.Errorf("%w: LockWait %v is over 1 hour", ErrInvalidConfig, c.LockWait)
	case c.QueryExecMode < 0 || c.QueryExecMode > pgx.QueryExecModeSimpleProtocol:
		return fmt.Errorf("%w: QueryExecMode %d is not a pgx.QueryExecMode", ErrInvalidConfig, c.QueryExecMode)
	}
	if c.Cache != nil {
		return c.Cache.validate()
	}
	return nil
}

// Client runs the protocol on one executor: a pool, a connection or a
// transaction. It is cheap; create one per transaction with WithTx.
type Client struct {
	d      driver
	cfg    Config
	mode   *execMode      // pgx and pgx-stdlib clients: shared with the clients WithTx derives
	wait   *time.Duration // Config.LockWait as claim's lock_wait: nil for the database's default
	hub    *hub           // pgx pool clients: the waiters' and the cache's listener
	cache  *cache         // Config.Cache, on a pool client and the clients WithTx derives
	inTx   bool           // derived by WithTx: reads the cache, puts only what another transaction committed
	schema *schemaState   // shared with the clients WithTx derives
	tr     Tracer         // Config.Tracer with Config.Observer (newTracer); nil when neither
}

// New returns a Client over a pgx pool, connection or transaction. It
// validates cfg (Config.Validate) and returns ErrInvalidConfig, naming
// the field, for a configuration it cannot run with: bad configuration
// fails at start-up, not at the first claim. Before its first claim a
// client checks, with one query, that schema idem has every function it
// calls, and refuses to claim with ErrNotMigrated otherwise (the clients
// WithTx derives share the check).
func New(db PgxExecutor, cfg *Config) (*Client, error) {
	if isNil(db) {
		return nil, fmt.Errorf("%w: New needs a database (a *pgxpool.Pool, *pgx.Conn or pgx.Tx), got nil", ErrInvalidConfig)
	}
	c, err := defaults(cfg)
	if err != nil {
		return nil, err
	}
	mode := &execMode{fixed: c.QueryExecMode, log: c.Logger}
	cl := &Client{d: newPgxDriver(db, mode), cfg: c, mode: mode, wait: lockWait(c.LockWait), schema: &schemaState{}, tr: newTracer(c)}
	pool, ok := db.(*pgxpool.Pool)
	switch {
	case ok && c.Cache != nil:
		cl.cache = newCache(*c.Cache)
		cl.hub = newHub(pool, c.Logger, cl.cache)
	case ok:
		cl.hub = newHub(pool, c.Logger, nil)
	case c.Cache != nil:
		return nil, fmt.Errorf("%w: Cache needs a client over a *pgxpool.Pool (it listens for releases on a connection of its own)", ErrInvalidConfig)
	}
	return cl, nil
}

// NewSQL returns a Client over database/sql: a *sql.DB, *sql.Conn or
// *sql.Tx. It validates cfg as New does. Over pgx's stdlib driver (a
// *sql.DB or *sql.Conn), it adapts its execution mode to a transaction
// pooler as New does (Config.QueryExecMode). It checks the schema before
// its first claim, as New does.
func NewSQL(db SQLExecutor, cfg *Config) (*Client, error) {
	if isNil(db) {
		return nil, fmt.Errorf("%w: NewSQL needs a database (a *sql.DB, *sql.Conn or *sql.Tx), got nil", ErrInvalidConfig)
	}
	c, err := defaults(cfg)
	if err != nil {
		return nil, err
	}
	if c.Cache != nil {
		return nil, fmt.Errorf("%w: Cache needs a client over a *pgxpool.Pool (New): it listens for releases, which database/sql cannot", ErrInvalidConfig)
	}
	mode := sqlExecMode(db, c.QueryExecMode, c.Logger)
	return &Client{d: newSQLDriver(db, mode), cfg: c, mode: mode, wait: lockWait(c.LockWait), schema: &schemaState{}, tr: newTracer(c)}, nil
}

// isNil: v is nil, or an interface holding a nil pointer.
func isNil(v any) bool {
	if v == nil {
		return true
	}
	rv := reflect.ValueOf(v)
	return rv.Kind() == reflect.Pointer && rv.IsNil()
}

// lockWait turns Config.LockWait into claim's lock_wait: 0 is the
// database's default (nil), negative is no wait at all.
func lockWait(d time.Duration) *time.Duration {
	switch {
	case d < 0:
		return new(time.Duration)
	case d > 0:
		return &d
	}
	return nil
}

func defaults(cfg *Config) (Config, error) {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if err := c.Validate(); err != nil {
		return c, err
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.HeartbeatFraction == 0 {
		c.HeartbeatFraction = DefaultHeartbeatFraction
	}
	if c.RecordTimeout == 0 {
		c.RecordTimeout = DefaultRecordTimeout
	}
	if c.EffectAcquireWait == 0 {
		c.EffectAcquireWait = DefaultEffectAcquireWait
	}
	return c, nil
}

// Close stops the connection a pool client listens on (Config.Cache keeps
// one open for the client's life; waiters open one while they wait). The
// client still works afterwards, without its cache and polling when it
// waits. Clients from WithTx share their parent's and need no Close.
func (c *Client) Close() {
	if c.inTx {
		return
	}
	if c.hub != nil {
		c.hub.close()
	}
	if c.cache != nil {
		c.cache.drop("")
	}
}

// WithTx returns a Client with the same configuration that runs inside tx.
// Claiming inside the transaction that also writes your business data makes
// the two commit or roll back together. A client with Config.Cache shares
// it with the clients it derives (see Config.Cache).
func (c *Client) WithTx(tx pgx.Tx) *Client {
	mode := c.mode
	if mode == nil { // a database/sql client: tx's own mode
		mode = &execMode{fixed: c.cfg.QueryExecMode, log: c.cfg.Logger}
	}
	return &Client{d: newPgxDriver(tx, mode), cfg: c.cfg, mode: mode, wait: c.wait,
		hub: c.hub, cache: c.cache, inTx: true, schema: c.schema, tr: c.tr}
}

// WithSQLTx is WithTx for database/sql. A client of pgx's stdlib driver
// shares its execution mode (Config.QueryExecMode) with the clients it
// derives.
func (c *Client) WithSQLTx(tx *sql.Tx) *Client {
	var mode *execMode
	if _, sqlClient := c.d.(sqlDriver); sqlClient {
		mode = c.mode
	}
	return &Client{d: newSQLDriver(tx, mode), cfg: c.cfg, mode: mode, wait: c.wait, schema: c.schema, tr: c.tr}
}

// ClaimOption adjusts one claim.
type ClaimOption func(*claimArgs)

// WithFingerprint sets the request fingerprint (see Fingerprint): the same
// key with a different fingerprint is answered with Mismatch.
func WithFingerprint(fp string) ClaimOption { return func(a *claimArgs) { a.fingerprint = fp } }

// WithTTL overrides the source's retention (1 minute to 10 years).
func WithTTL(d time.Duration) ClaimOption { return func(a *claimArgs) { a.ttl = d } }

// WithLease overrides the source's lease (1 second to 7 days).
func WithLease(d time.Duration) ClaimOption { return func(a *claimArgs) { a.lease = d } }

// WithLockWait bounds how long this claim waits for another claim of the
// same key whose transaction is still open (0: not at all, at most 1
// hour); past it the claim answers InProgress. Overrides Config.LockWait.
func WithLockWait(d time.Duration) ClaimOption { return func(a *claimArgs) { a.lockWait = &d } }

// WithEventType records the event type (informational, for stats).
func WithEventType(t string) ClaimOption { return func(a *claimArgs) { a.eventType = t } }

// Claim asks to own the work for (source, key).
func (c *Client) Claim(ctx context.Context, source, key string, opts ...ClaimOption) (*Claim, error) {
	if c.tr == nil {
		return c.claim(ctx, source, key, opts)
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpClaim, Source: source, Key: key})
	cl, err := c.claim(ctx, source, key, opts)
	c.traceEnd(ctx, start, TraceEndData{Op: OpClaim, Source: source, Key: key, Claim: cl, Err: err})
	return cl, err
}

func (c *Client) claim(ctx context.Context, source, key string, opts []ClaimOption) (*Claim, error) {
	a := claimArgs{source: source, key: key, lockWait: c.wait}
	for _, o := range opts {
		o(&a)
	}
	if err := c.check("claim", source, key, a.fingerprint, a.eventType); err != nil {
		return nil, err
	}
	if err := c.checkWait(&a); err != nil {
		return nil, err
	}
	if err := c.ready(ctx, source, key); err != nil {
		return nil, err
	}
	var gen uint64
	cached := c.cache != nil && c.hub.fresh()
	if cached {
		if cl, ok := c.cache.get(source, key, a.fingerprint); ok {
			if c.tr != nil {
				cctx, start := c.traceStart(ctx, TraceStartData{Op: OpCache, Source: source, Key: key})
				c.traceEnd(cctx, start, TraceEndData{Op: OpCache, Source: source, Key: key, Claim: cl})
			}
			return cl, nil
		}
		gen = c.cache.generation()
	}
	cl, err := c.d.claim(boundAcquire(ctx, a.acquireWait), a)
	if err != nil {
		err = convert("claim", source, key, err)
		c.forgetSchema(err)
		return nil, err
	}
	if cached && cl.Outcome == Completed && c.hub.fresh() {
		ok := true
		if c.inTx {
			// Inside the caller's transaction the completion may be this
			// transaction's own (Do twice in it) and roll back, or (above
			// READ COMMITTED) older than a release heard before gen was
			// read: cache it only when this transaction has written nothing
			// and reads with a snapshot per statement.
			if ok, err = c.d.cacheable(ctx); err != nil {
				return nil, convert("claim", source, key, err)
			}
		}
		if ok {
			c.cache.put(source, key, a.fingerprint, cl, gen)
		}
	}
	if cl.Outcome == InProgress && a.wait > 0 {
		wctx, start := c.traceStart(ctx, TraceStartData{Op: OpWait, Source: source, Key: key})
		cl, err = c.waitFor(wctx, a, cl)
		c.traceEnd(wctx, start, TraceEndData{Op: OpWait, Source: source, Key: key, Claim: cl, Err: err})
		if err != nil {
			return nil, err
		}
	}
	return cl, nil
}

// Complete stores result (JSON; nil stores SQL NULL) for the work owned by
// token. It returns ErrStaleToken if another worker owns the key now, and
// nil when the same token already completed it.
func (c *Client) Complete(ctx context.Context, source, key string, token int64, result json.RawMessage) error {
	_, err := c.complete(ctx, source, key, token, result, false)
	return err
}

// complete is Complete; with echo it returns the result as stored.
func (c *Client) complete(ctx context.Context, source, key string, token int64, result json.RawMessage, echo bool) (json.RawMessage, error) {
	if c.tr == nil {
		return c.completeUntraced(ctx, source, key, token, result, echo)
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpComplete, Source: source, Key: key})
	stored, err := c.completeUntraced(ctx, source, key, token, result, echo)
	c.traceEnd(ctx, start, TraceEndData{Op: OpComplete, Source: source, Key: key, Err: err})
	return stored, err
}

func (c *Client) completeUntraced(ctx context.Context, source, key string, token int64, result json.RawMessage, echo bool) (json.RawMessage, error) {
	if err := c.check("complete", source, key); err != nil {
		return nil, err
	}
	if err := CheckResult(result); err != nil {
		e := err.(*Error)
		e.Source, e.Key = source, key
		return nil, e
	}
	var out string
	var stored []byte
	err := c.d.guard(ctx, len(result) > mayExceedLimit, func() (err error) {
		out, stored, err = c.d.complete(ctx, source, key, token, result, echo)
		return err
	})
	if err != nil && echo && c.d.concurrent() && sqlstate.Of(err) == sqlstate.UndefinedFunction {
		// The schema was migrated down under the client (idem.complete_stored
		// is version 11's): complete with version 1's idem.complete, so the
		// work that ran is recorded; the next claim checks the schema again.
		c.forgetSchema(ErrNotMigrated)
		out, _, err = c.d.complete(ctx, source, key, token, result, false)
		stored = result
	}
	if err != nil {
		err = convert("complete", source, key, err)
		c.forgetSchema(err)
		return nil, err
	}
	return stored, outcomeErr("complete", source, key, out)
}

// CompleteUnstored marks the work owned by token done without a result:
// the work ran, but its result cannot be stored (too large, not JSON, a NUL
// character). Later claims answer Completed with no Result and Claim.Error
// giving reason, instead of running the work again. Do calls it by itself.
func (c *Client) CompleteUnstored(ctx context.Context, source, key string, token int64, reason string) (err error) {
	if err := c.check("complete", source, key); err != nil {
		return err
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpComplete, Source: source, Key: key})
	defer func() { c.traceEnd(ctx, start, TraceEndData{Op: OpComplete, Source: source, Key: key, Err: err}) }()
	out, err := c.d.completeUnstored(ctx, source, key, token, StorableText(reason))
	if err != nil {
		return convert("complete", source, key, err)
	}
	return outcomeErr("complete", source, key, out)
}

// Fail records a failure of the work owned by token. A retryable failure
// lets the next claim re-acquire the key; a permanent one answers Failed
// until the key expires.
func (c *Client) Fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) (err error) {
	if err := c.check("fail", source, key); err != nil {
		return err
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpFail, Source: source, Key: key})
	defer func() { c.traceEnd(ctx, start, TraceEndData{Op: OpFail, Source: source, Key: key, Err: err}) }()
	out, err := c.d.fail(ctx, source, key, token, StorableText(msg), retryable)
	if err != nil {
		return convert("fail", source, key, err)
	}
	return outcomeErr("fail", source, key, out)
}

// FailMomentary records a failure about the moment, not the work (an
// error marked Momentary: rate limited, a dependency briefly down): the
// key is released for a retry and the attempt the claim counted is taken
// back, so it does not count toward the source's max_attempts (migration
// 20). Do and DoBatch call it for their work's Momentary errors; the inbox
// for a handler's.
func (c *Client) FailMomentary(ctx context.Context, source, key string, token int64, msg string) (err error) {
	if err := c.check("fail", source, key); err != nil {
		return err
	}
	ctx, start := c.traceStart(ctx, TraceStartData{Op: OpFail, Source: source, Key: key})
	defer func() { c.traceEnd(ctx, start, TraceEndData{Op: OpFail, Source: source, Key: key, Err: err}) }()
	out, err := c.d.failMomentary(ctx, source, key, token, StorableText(msg))
	if err != nil {
		return convert("fail", source, key, err)
	}
	return outcomeErr("fail", source, key, out)
}

// Extend pushes the lease of the work owned by token to now+lease (the
// source's policy lease when lease is 0) and returns the new expiry.
func (c *Client) Extend(ctx context.Context, source, key string, token int64, lease time.Duration) (time.Time, error) {
	if err := c.check("extend", source, key); err != nil {
		return time.Time{}, err
	}
	out, until, err := c.d.extend(ctx, source, key, token, lease)
	if err != nil {
		return time.Time{}, convert("extend", source, key, err)
	}
	return until, outcomeErr("extend", source, key, out)
}

// check is every operation's preamble: what PostgreSQL text cannot hold.
func (c *Client) check(op, source, key string, more ...string) error {
	return checkText(op, source, key, more...)
}

type errorString string

func (e errorString) Error() string { return string(e) }

// checkText rejects what PostgreSQL text cannot hold (NUL bytes, invalid
// UTF-8: CheckText) before it reaches the server, whose own error would be
// obscure, and a source holding an ASCII control character, as
// idem.check_key does (migration 15): idem joins a source and a key with
// one (0x1F) for the per-key lock and the wait channel, and the cache is
// consulted before the server. Lengths and blankness are checked by the
// SQL functions.
func checkText(op, source, key string, more ...string) error {
	names := [...]string{"source", "key", "fingerprint", "event type"}
	for i := range 2 + len(more) {
		s := source
		switch {
		case i == 1:
			s = key
		case i > 1:
			s = more[i-2]
		}
		if err := CheckText(names[min(i, len(names)-1)], s); err != nil {
			e := err.(*Error)
			e.Op, e.Source, e.Key = op, source, key
			return e
		}
		if i == 0 && strings.IndexFunc(s, isControl) >= 0 {
			return &Error{Op: op, Source: source, Key: key, Kind: ErrInvalidInput,
				Err: errorString("source contains a control character")}
		}
	}
	return nil
}

// isControl is an ASCII control character (0x00-0x1F, 0x7F): what a
// source may not contain, in Go as in idem.check_key.
func isControl(r rune) bool { return r < 0x20 || r == 0x7f }
