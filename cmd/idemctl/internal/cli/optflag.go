package cli

import (
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/internal/maintcfg"
)

// optional is a flag that sets *p only when it is given on the command
// line, so that the package behind it tells "not given" (nil: its
// documented default) from a value, zero included. Its usage text names
// the default.
type optional[T any] struct {
	p     **T
	parse func(string) (T, error)
	typ   string
}

// Type names the value in help (pflag.Value).
func (o optional[T]) Type() string { return o.typ }

func (o optional[T]) String() string {
	if o.p == nil || *o.p == nil {
		return ""
	}
	return fmt.Sprint(**o.p)
}

func (o optional[T]) Set(s string) error {
	v, err := o.parse(s)
	if err != nil {
		return err
	}
	*o.p = &v
	return nil
}

func optInt(fs *pflag.FlagSet, p **int, name string, def int, usage string) {
	fs.Var(optional[int]{p, strconv.Atoi, "int"}, name, fmt.Sprintf("%s (default %d)", usage, def))
}

func optInt64(fs *pflag.FlagSet, p **int64, name, def, usage string) {
	fs.Var(optional[int64]{p, func(s string) (int64, error) { return strconv.ParseInt(s, 10, 64) }, "int"}, name, fmt.Sprintf("%s (default %s)", usage, def))
}

func optDuration(fs *pflag.FlagSet, p **time.Duration, name, def, usage string) {
	fs.Var(optional[time.Duration]{p, time.ParseDuration, "duration"}, name, fmt.Sprintf("%s (default %s)", usage, def))
}

// configErr turns a maintenance package's Validate error into a usage
// error that names the flag (flags maps Config fields to flag names).
func configErr(err error, flags map[string]string) error {
	var ce *maintcfg.Error
	if errors.As(err, &ce) {
		if name, ok := flags[ce.Field]; ok {
			return usageErr("%s %s", name, ce.Problem)
		}
	}
	return usageErr("%v", err)
}

var pruneFlagNames = map[string]string{
	"BatchSize": "--batch-size", "Sleep": "--sleep", "MaxDuration": "--max-duration", "LockTTL": "--lock-ttl",
	"LockTimeout": "--lock-timeout", "StatementTimeout": "--statement-timeout", "Retries": "--batch-retries",
}

func rotateFlagNames(prefix string) map[string]string {
	return map[string]string{
		"Premake": "--premake", "Retries": "--retries", "Backoff": "--backoff", "LockTTL": "--" + prefix + "lock-ttl",
		"LockTimeout": "--lock-timeout", "StatementTimeout": "--statement-timeout", "MaxMoveRows": "--max-move-rows",
	}
}
