// Package migrations holds idem's goose migrations, embedded so that an
// application can apply them from its own binary. Most callers want the
// helpers in package github.com/idemkit/idem/migrate instead, which set
// idem's own version table and advisory lock id.
package migrations

import "embed"

// FS holds the migration files (NNNNN_name.sql) at its root.
//
//go:embed *.sql
var FS embed.FS
