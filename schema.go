package idem

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
)

// requiredFunctions are the SQL functions the client calls, as regprocedure
// signatures. Before its first claim a client checks that the schema has
// every one (a code deployed before `idemctl migrate up`, or a schema
// migrated down under it), and refuses to claim with ErrNotMigrated
// otherwise: the work must not run when its outcome cannot be recorded. A
// migration that adds a function the client calls adds it here.
var requiredFunctions = strings.Join([]string{
	"idem.claim(text,text,text,interval,interval,text,interval)",
	"idem.complete(text,text,bigint,jsonb)",
	"idem.complete_stored(text,text,bigint,jsonb)",
	"idem.complete_unstored(text,text,bigint,text)",
	"idem.fail(text,text,bigint,text,boolean)",
	"idem.extend(text,text,bigint,interval)",
	"idem.peek(text,text)",
	"idem.wait_begin(text,text,interval)",
	"idem.wait_end(bigint)",
}, ";")

// batchFunctions are the SQL functions of the batch calls (migration 18),
// checked apart from requiredFunctions, before a client's first batch:
// a schema before 18 still serves single claims.
var batchFunctions = strings.Join([]string{
	"idem.claim_batch(text,text[],text[],interval,interval,text[],interval)",
	"idem.complete_batch(text,text[],bigint[],jsonb[])",
	"idem.fail_batch(text,text[],bigint[],text[],boolean[])",
}, ";")

// schemaState remembers that the schema had every required function; it is
// shared by a client and those WithTx derives, and forgotten when a call
// finds a function missing, so the next claim checks again.
type schemaState struct {
	ok, batchOK atomic.Bool
	// citus: idem is distributed (Citus), asked with the batch functions:
	// a batch is claimed by node (driver_citus.go).
	citus atomic.Bool
}

// ready checks, once per client until a function goes missing, that the
// schema has every function the client calls.
func (c *Client) ready(ctx context.Context, source, key string) error {
	if c.schema == nil || c.schema.ok.Load() {
		return nil
	}
	missing, err := c.d.missingFunctions(ctx, requiredFunctions)
	if err != nil {
		return convert("claim", source, key, err)
	}
	if missing != "" {
		return &Error{Op: "claim", Source: source, Key: key, Kind: ErrNotMigrated,
			Err: fmt.Errorf("schema idem lacks %s: migrate it up (idemctl migrate up) before this code claims anything", missing)}
	}
	c.schema.ok.Store(true)
	return nil
}

// batchReady is ready for the batch calls: the schema has every function a
// client calls, and the batch functions.
func (c *Client) batchReady(ctx context.Context, source string) error {
	if err := c.ready(ctx, source, ""); err != nil || c.schema == nil || c.schema.batchOK.Load() {
		return err
	}
	missing, err := c.d.missingFunctions(ctx, batchFunctions)
	if err != nil {
		return convert("claim", source, "", err)
	}
	if missing != "" {
		return &Error{Op: "claim", Source: source, Kind: ErrNotMigrated,
			Err: fmt.Errorf("schema idem lacks %s (migration 18): migrate it up (idemctl migrate up) before this code claims in batches", missing)}
	}
	d, err := c.d.distributed(ctx)
	if err != nil {
		return convert("claim", source, "", err)
	}
	c.schema.citus.Store(d)
	c.schema.batchOK.Store(true)
	return nil
}

// forgetSchema makes the next claim check the schema again after err (an
// operation found a function missing).
func (c *Client) forgetSchema(err error) {
	if c.schema != nil && errors.Is(err, ErrNotMigrated) {
		c.schema.ok.Store(false)
		c.schema.batchOK.Store(false)
	}
}

func (d pgxDriver) missingFunctions(ctx context.Context, functions string) (string, error) {
	return d.q.MissingFunctions(ctx, functions)
}

func (d sqlDriver) missingFunctions(ctx context.Context, functions string) (string, error) {
	return sqlRetry(d, func() (string, error) { return d.q.MissingFunctions(ctx, functions) })
}
