package dashboard

import (
	"context"
	"errors"

	"github.com/jackc/pgx/v5/pgconn"
)

// errorsIsDeadline tells a query that ran out of Config.QueryTimeout (the
// context's deadline, or the server's statement cancelled by it).
func errorsIsDeadline(err error) bool {
	if errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var pg *pgconn.PgError
	return errors.As(err, &pg) && pg.Code == "57014" // query_canceled
}
