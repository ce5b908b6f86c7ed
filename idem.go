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
//	c := idem.New(pool, nil)
//	res, err := c.Do(ctx, "stripe", event.ID, func(ctx context.Context) (any, error) {
//		return chargeCustomer(ctx, event)
//	})
package idem

import (
	"context"
	"database/sql"
	"encoding/json"
	"log/slog"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/db/pgxdb"
	"github.com/idemkit/idem/db/sqldb"
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

	lease time.Duration // the lease asked for (0: the source's policy)
}

// Config configures a Client. The zero value (or nil) is valid.
type Config struct {
	// Logger receives warnings (a failed release after a panic, a lost
	// lease). Default: slog.Default().
	Logger *slog.Logger
	// HeartbeatFraction: Do extends the lease every lease*fraction while the
	// work runs, when the client is backed by a pool. Default 1/3; a negative
	// value turns the heartbeat off.
	HeartbeatFraction float64
}

// Client runs the protocol on one executor: a pool, a connection or a
// transaction. It is cheap; create one per transaction with WithTx.
type Client struct {
	d   driver
	cfg Config
}

// New returns a Client over a pgx pool, connection or transaction.
func New(db PgxExecutor, cfg *Config) *Client {
	return &Client{d: pgxDriver{q: pgxdb.New(db), db: db}, cfg: defaults(cfg)}
}

// NewSQL returns a Client over database/sql: a *sql.DB, *sql.Conn or *sql.Tx.
func NewSQL(db SQLExecutor, cfg *Config) *Client {
	return &Client{d: sqlDriver{q: sqldb.New(db), db: db}, cfg: defaults(cfg)}
}

func defaults(cfg *Config) Config {
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.HeartbeatFraction == 0 {
		c.HeartbeatFraction = 1.0 / 3
	}
	return c
}

// WithTx returns a Client with the same configuration that runs inside tx.
// Claiming inside the transaction that also writes your business data makes
// the two commit or roll back together.
func (c *Client) WithTx(tx pgx.Tx) *Client {
	return &Client{d: pgxDriver{q: pgxdb.New(tx), db: tx}, cfg: c.cfg}
}

// WithSQLTx is WithTx for database/sql.
func (c *Client) WithSQLTx(tx *sql.Tx) *Client {
	return &Client{d: sqlDriver{q: sqldb.New(tx), db: tx}, cfg: c.cfg}
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

// WithEventType records the event type (informational, for stats).
func WithEventType(t string) ClaimOption { return func(a *claimArgs) { a.eventType = t } }

// Claim asks to own the work for (source, key).
func (c *Client) Claim(ctx context.Context, source, key string, opts ...ClaimOption) (*Claim, error) {
	a := claimArgs{source: source, key: key}
	for _, o := range opts {
		o(&a)
	}
	if err := checkText("claim", source, key, a.fingerprint, a.eventType); err != nil {
		return nil, err
	}
	cl, err := c.d.claim(ctx, a)
	if err != nil {
		return nil, convert("claim", source, key, err)
	}
	cl.lease = a.lease
	return cl, nil
}

// Complete stores result (JSON; nil stores SQL NULL) for the work owned by
// token. It returns ErrStaleToken if another worker owns the key now, and
// nil when the same token already completed it.
func (c *Client) Complete(ctx context.Context, source, key string, token int64, result json.RawMessage) error {
	if err := checkText("complete", source, key); err != nil {
		return err
	}
	if result != nil && !json.Valid(result) {
		return &Error{Op: "complete", Source: source, Key: key, Kind: ErrInvalidInput,
			Err: errorString("result is not valid JSON")}
	}
	out, err := c.d.complete(ctx, source, key, token, result)
	if err != nil {
		return convert("complete", source, key, err)
	}
	return outcomeErr("complete", source, key, out)
}

// Fail records a failure of the work owned by token. A retryable failure
// lets the next claim re-acquire the key; a permanent one answers Failed
// until the key expires.
func (c *Client) Fail(ctx context.Context, source, key string, token int64, msg string, retryable bool) error {
	if err := checkText("fail", source, key); err != nil {
		return err
	}
	out, err := c.d.fail(ctx, source, key, token, sanitize(msg), retryable)
	if err != nil {
		return convert("fail", source, key, err)
	}
	return outcomeErr("fail", source, key, out)
}

// Extend pushes the lease of the work owned by token to now+lease (the
// source's policy lease when lease is 0) and returns the new expiry.
func (c *Client) Extend(ctx context.Context, source, key string, token int64, lease time.Duration) (time.Time, error) {
	if err := checkText("extend", source, key); err != nil {
		return time.Time{}, err
	}
	out, until, err := c.d.extend(ctx, source, key, token, lease)
	if err != nil {
		return time.Time{}, convert("extend", source, key, err)
	}
	return until, outcomeErr("extend", source, key, out)
}

type errorString string

func (e errorString) Error() string { return string(e) }

// checkText rejects what PostgreSQL text cannot hold (NUL bytes, invalid
// UTF-8) before it reaches the server, whose own error would be obscure.
// Lengths and blankness are checked by the SQL functions, the one authority.
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
		var problem string
		switch {
		case !utf8.ValidString(s):
			problem = " is not valid UTF-8"
		case strings.IndexByte(s, 0) >= 0:
			problem = " contains a NUL byte"
		default:
			continue
		}
		return &Error{Op: op, Source: source, Key: key, Kind: ErrInvalidInput,
			Err: errorString(names[min(i, len(names)-1)] + problem)}
	}
	return nil
}

// sanitize makes an error message storable as text.
func sanitize(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}
