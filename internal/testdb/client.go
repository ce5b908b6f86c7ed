package testdb

import (
	"testing"

	"github.com/idemkit/idem"
)

// Client is idem.New(db, cfg), failing the test on an error.
func Client(t testing.TB, db idem.PgxExecutor, cfg *idem.Config) *idem.Client {
	t.Helper()
	c, err := idem.New(db, cfg)
	if err != nil {
		t.Fatalf("testdb: idem.New: %v", err)
	}
	return c
}

// SQLClient is idem.NewSQL(db, cfg), failing the test on an error.
func SQLClient(t testing.TB, db idem.SQLExecutor, cfg *idem.Config) *idem.Client {
	t.Helper()
	c, err := idem.NewSQL(db, cfg)
	if err != nil {
		t.Fatalf("testdb: idem.NewSQL: %v", err)
	}
	return c
}
