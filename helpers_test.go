package idem_test

import (
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// isSerialization reports a PostgreSQL serialization failure that did not
// pass through idem (for example at COMMIT).
func isSerialization(err error) bool {
	var pg *pgconn.PgError
	return errors.As(err, &pg) && (pg.Code == "40001" || pg.Code == "40P01")
}
