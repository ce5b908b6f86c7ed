package idem

import (
	"context"
	"encoding/json"
	"fmt"
)

// The typed forms of Do and Effect are functions, not methods, because Go
// methods cannot have type parameters: DoValue(ctx, c, ...) is c.Do for a
// T, EffectValue(ctx, c, ...) is c.Effect for a T, with the same arguments
// and the same answers.

// DoValue is Do for work returning a T: the value is stored as JSON and
// decoded into a T from the stored result, for the call whose work ran as
// for every duplicate, so each sees the same value (T must survive a JSON
// round trip). Do's errors are returned as Do returns them (ErrInProgress,
// ErrMismatch, *FailedError, fn's own error). A call whose work ran but
// whose result could not be stored, and every duplicate of it, returns the
// zero T and an error matching ErrResultNotStored. For Replayed, or the
// claim (its LeaseRemaining when another worker holds the key), call Do.
func DoValue[T any](ctx context.Context, c *Client, source, key string, fn func(ctx context.Context) (T, error), opts ...ClaimOption) (T, error) {
	res, err := c.Do(ctx, source, key, func(ctx context.Context) (any, error) {
		v, err := fn(ctx)
		return typedValue{v}, err
	}, opts...)
	if err != nil {
		var zero T
		return zero, err
	}
	return decodeResult[T](res, func(err error) error {
		return &Error{Op: "do", Source: source, Key: key, Err: err}
	})
}

// typedValue is a DoValue or EffectValue result: always marshalled with
// encoding/json, as decodeResult decodes it (Do stores a bare []byte or
// json.RawMessage as is, which would lose a []byte T: binary bytes are no
// JSON, and bytes that are would not decode back into a []byte).
type typedValue struct{ v any }

// decodeResult decodes a stored result into a T; wrap makes its errors.
func decodeResult[T any](res *Result, wrap func(error) error) (T, error) {
	var v T
	if res.Result == nil {
		if res.NotStored != "" {
			return v, wrap(fmt.Errorf("%w: %s", ErrResultNotStored, res.NotStored))
		}
		return v, nil
	}
	if err := json.Unmarshal(res.Result, &v); err != nil {
		return v, wrap(fmt.Errorf("decode the stored result: %w", err))
	}
	return v, nil
}

// EffectValue is Effect for a function returning a T: the result is stored
// as JSON and decoded into a T, on the first run as on every replay, so
// the caller sees the same value each time (T must survive a JSON round
// trip). A replay of an effect whose result could not be stored returns
// the zero T and an error matching ErrResultNotStored.
func EffectValue[T any](ctx context.Context, c *Client, name string, fn func(ctx context.Context) (T, error), opts ...EffectOption) (T, error) {
	var zero T
	res, err := c.Effect(ctx, name, func(ctx context.Context) (any, error) {
		v, err := fn(ctx)
		return typedValue{v}, err
	}, opts...)
	if err != nil {
		return zero, err
	}
	return decodeResult[T](res, func(err error) error {
		ev, _ := EventFrom(ctx) // Effect found it
		return &EffectError{Name: name, EventSource: ev.Source, EventKey: ev.Key, Err: err}
	})
}
