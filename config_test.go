package idem_test

import (
	"context"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem"
)

// TestConfigValidate: a Config out of range is refused by New and NewSQL
// (ErrInvalidConfig, naming the field), as is a nil database or a Cache
// where no listener can run; valid ones work.
func TestConfigValidate(t *testing.T) {
	t.Parallel()
	pool, _ := setup(t)
	ctx := context.Background()
	for name, cfg := range map[string]idem.Config{
		"heartbeat fraction 1":             {HeartbeatFraction: 1},
		"heartbeat fraction NaN":           {HeartbeatFraction: math.NaN()},
		"negative record timeout":          {RecordTimeout: -time.Second},
		"lock wait over an hour":           {LockWait: 2 * time.Hour},
		"effect acquire wait over an hour": {EffectAcquireWait: 2 * time.Hour},
		"not a pgx query exec mode":        {QueryExecMode: pgx.QueryExecMode(99)},
	} {
		t.Run(name, func(t *testing.T) {
			if err := cfg.Validate(); !errors.Is(err, idem.ErrInvalidConfig) {
				t.Fatalf("Validate: %v, want ErrInvalidConfig", err)
			}
			// Refused at construction, by both constructors: no Client
			// to fail at its first claim in production.
			if c, err := idem.New(pool, &cfg); !errors.Is(err, idem.ErrInvalidConfig) || c != nil {
				t.Fatalf("New: %v %v, want ErrInvalidConfig and no Client", c, err)
			}
			if c, err := idem.NewSQL(stdlib.OpenDBFromPool(pool), &cfg); !errors.Is(err, idem.ErrInvalidConfig) || c != nil {
				t.Fatalf("NewSQL: %v %v, want ErrInvalidConfig and no Client", c, err)
			}
		})
	}
	var nilPool *pgxpool.Pool
	for name, err := range map[string]error{
		"nil database": func() error { _, err := idem.New(nil, nil); return err }(),
		"nil pool":     func() error { _, err := idem.New(nilPool, nil); return err }(),
		"nil sql.DB":   func() error { _, err := idem.NewSQL(nil, nil); return err }(),
		"cache over database/sql": func() error {
			_, err := idem.NewSQL(stdlib.OpenDBFromPool(pool), &idem.Config{Cache: &idem.CacheConfig{}})
			return err
		}(),
		"cache size out of range": func() error { _, err := idem.New(pool, &idem.Config{Cache: &idem.CacheConfig{Size: -1}}); return err }(),
	} {
		if !errors.Is(err, idem.ErrInvalidConfig) {
			t.Errorf("%s: %v, want ErrInvalidConfig", name, err)
		}
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
			c, err := idem.New(pool, cfg)
			if err != nil {
				t.Fatal(err)
			}
			res, err := c.Do(ctx, "cfg", "valid-"+name, func(context.Context) (any, error) { return map[string]int{"ok": 1}, nil })
			if err != nil || string(res.Result) != `{"ok": 1}` {
				t.Fatalf("Do: %+v %v", res, err)
			}
		})
	}
}
