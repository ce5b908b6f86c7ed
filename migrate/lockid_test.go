package migrate_test

import (
	"encoding/binary"
	"io/fs"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/migrate"
)

// TestLockIDs: the advisory lock ids are what LockID's comment says:
// "idem" as a big-endian integer, +0 in idem.claim, +1 for migrations, +2
// for the maintenance locks' gate.
func TestLockIDs(t *testing.T) {
	base := int64(binary.BigEndian.Uint32([]byte("idem")))
	if migrate.LockID != base+1 {
		t.Fatalf("LockID %d, want %d", migrate.LockID, base+1)
	}
	var all strings.Builder
	err := fs.WalkDir(migrate.FS(), ".", func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !strings.HasSuffix(path, ".sql") {
			return err
		}
		b, err := fs.ReadFile(migrate.FS(), path)
		all.Write(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"pg_try_advisory_xact_lock(" + strconv.FormatInt(base, 10) + ", ",
		"pg_advisory_xact_lock(" + strconv.FormatInt(base+2, 10) + ", ",
	} {
		if !strings.Contains(all.String(), want) {
			t.Errorf("no %q in the migrations", want)
		}
	}
}
