package maintlock

import (
	"context"
	"errors"
	"net"
	"regexp"

	"github.com/jackc/pgx/v5/pgconn"
)

// SafeError is what idem.runs stores of a failed run's error, which the
// dashboard's /maintenance page shows to whoever can reach it: what the
// operator can act on, never a part of the connection (user, database,
// host, port, socket path, URL). The driver's text goes to the log.
func SafeError(err error) string {
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case err == nil:
		return ""
	case errors.As(err, &ce):
		return "could not connect to the database: check that it is up and that the daemon's role can log in (the log has the driver's error)"
	case errors.Is(err, context.DeadlineExceeded):
		return "timed out (the log has the driver's error)"
	case errors.Is(err, context.Canceled):
		return "interrupted"
	case errors.As(err, &ne):
		return "the connection to the database failed (the log has the driver's error)"
	}
	var pg *pgconn.PgError
	if errors.As(err, &pg) {
		return Scrub(pg.Message + " (SQLSTATE " + pg.Code + ")")
	}
	return Scrub(err.Error())
}

// scrubs are the parts of a driver's text that name the connection.
var scrubs = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`(?i)postgres(?:ql)?://\S+`), "postgres://…"},
	{regexp.MustCompile(`(?i)\b(user|database|dbname|host|hostaddr|port|password|sslrootcert|service)\s*=\s*("[^"]*"|'[^']*'|[^\s` + "`" + `]+)`), "$1=…"},
	{regexp.MustCompile(`(?i)\b(user|role|database|host)\s+"[^"]*"`), `$1 "…"`},
	{regexp.MustCompile(`\S*\.s\.PGSQL\.\d+`), "…"},
	{regexp.MustCompile(`\[[0-9A-Fa-f:.%\w]*:[0-9A-Fa-f:.%\w]*\](:\d+)?`), "…"},
	{regexp.MustCompile(`\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b`), "…"},
	{regexp.MustCompile(`\b[A-Za-z0-9][A-Za-z0-9.-]*:\d{2,5}\b`), "…"},
	{regexp.MustCompile(`\((?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)\)`), "(…)"},
}

// Scrub removes from an error's text what names the connection (see
// SafeError): for text stored before SafeError was, or not from a driver.
func Scrub(s string) string {
	for _, r := range scrubs {
		s = r.re.ReplaceAllString(s, r.with)
	}
	return s
}
