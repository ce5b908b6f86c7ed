package idem_test

import (
	"os"
	"testing"

	"github.com/idemkit/idem/internal/testdb"
)

func TestMain(m *testing.M) {
	if os.Getenv(cacheChildEnv) != "" {
		os.Exit(cacheChild())
	}
	testdb.Main(m)
}
