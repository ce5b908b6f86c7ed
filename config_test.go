package idem_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := setup(t)
	ctx := context.Background()
	for name, cfg := range map[string]idem.Config{
		"heartbeat fraction 1":      {HeartbeatFraction: 1},
		"heartbeat fraction NaN":    {HeartbeatFraction: math.NaN()},
		"negative record timeout":   {RecordTimeout: -time.Second},
		"lock wait over an hour":    {LockWait: 2 * time.Hour},
		"not a pgx query exec mode": {QueryExecMode: pgx.QueryExecMode(99)},
	} {
		t.Run(name, func(t *testing.T) {
			if err := cfg.Validate(); !errors.Is(err, idem.ErrInvalidConfig) {
				t.Fatalf("Validate: %v, want ErrInvalidConfig", err)
			}
			c := idem.New(pool, &cfg)
			if _, err := c.Claim(ctx, "cfg", "k"); !errors.Is(err, idem.ErrInvalidConfig) {
				t.Fatalf("Claim: %v, want ErrInvalidConfig", err)
			}
			if _, err := c.Do(ctx, "cfg", "k", func(context.Context) (any, error) {
				t.Fatal("the work ran with an invalid config")
				return nil, nil
			}); !errors.Is(err, idem.ErrInvalidConfig) {
				t.Fatalf("Do: %v, want ErrInvalidConfig", err)
			}
		})
	}
	for name, cfg := range map[string]*idem.Config{
		"nil":                     nil,
		"zero":                    {},
		"heartbeat off":           {HeartbeatFraction: -1},
		"no lock wait":            {LockWait: -1},
		"statement cache":         {QueryExecMode: pgx.QueryExecModeCacheStatement},
		"simple protocol":         {QueryExecMode: pgx.QueryExecModeSimpleProtocol},
		"explicit record timeout": {RecordTimeout: time.Second},
	} {
		t.Run("valid "+name, func(t *testing.T) {
			if err := cfg.Validate(); err != nil {
				t.Fatal(err)
			}
			c := idem.New(pool, cfg)
			res, err := c.Do(ctx, "cfg", "valid-"+name, func(context.Context) (any, error) { return map[string]int{"ok": 1}, nil })
			if err != nil || string(res.Result) != `{"ok": 1}` {
				t.Fatalf("Do: %+v %v", res, err)
			}
		})
	}
}
