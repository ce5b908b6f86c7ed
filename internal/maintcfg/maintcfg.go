// Package maintcfg holds what the maintenance packages' configurations
// (internal/prune, internal/partition) share: the error Validate returns,
// and reading a setting that is unset (nil) or given.
package maintcfg

import (
	"errors"
	"fmt"
	"math"
	"time"
)

// MaxTimeout is the longest lock_timeout or statement_timeout PostgreSQL
// takes (2,147,483,647 ms, about 24.8 days).
const MaxTimeout = time.Duration(math.MaxInt32) * time.Millisecond

// ErrInvalidConfig is matched by every *Error.
var ErrInvalidConfig = errors.New("invalid maintenance configuration")

// Error names the Config field Validate refused and why.
type Error struct {
	Pkg     string // "prune", "rotate"
	Field   string // "BatchSize"
	Problem string // "0 is out of range (1 to 1000000)"
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s %s", e.Pkg, e.Field, e.Problem) }

// Is makes errors.Is(err, ErrInvalidConfig) true.
func (e *Error) Is(target error) bool { return target == ErrInvalidConfig }

// Bad returns an *Error for pkg's field.
func Bad(pkg, field, format string, a ...any) error {
	return &Error{Pkg: pkg, Field: field, Problem: fmt.Sprintf(format, a...)}
}

// Or is *p when the setting was given, else def.
func Or[T any](p *T, def T) T {
	if p != nil {
		return *p
	}
	return def
}
