package oteltest_test

import (
	"os"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(child())
	}
	testdb.Main(m)
}
