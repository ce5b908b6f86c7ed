package idem_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem"
)

// TestBadInputSQL calls the protocol functions the way psql or another
// language would and checks each bad input's SQLSTATE and message.
func TestBadInputSQL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool, _ := setup(t)
	// A live row for the complete/fail/extend cases.
	var token int64
	if err := pool.QueryRow(ctx, `SELECT token FROM idem.claim('s', 'k')`).Scan(&token); err != nil {
		t.Fatal(err)
	}
	long := func(n int) string { return strings.Repeat("x", n) }
	cases := []struct {
		name, sql string
		args      []any
		code, msg string
	}{
		{"null source", `SELECT * FROM idem.claim(NULL, 'k')`, nil, "22004", "idem.claim: source must not be NULL"},
		{"null key", `SELECT * FROM idem.claim('s', NULL)`, nil, "22004", "idem.claim: key must not be NULL"},
		{"empty source", `SELECT * FROM idem.claim('', 'k')`, nil, "22023", "idem.claim: source must not be empty"},
		{"blank source", `SELECT * FROM idem.claim(E' \t\n', 'k')`, nil, "22023", "idem.claim: source must not be empty"},
		{"empty key", `SELECT * FROM idem.claim('s', '')`, nil, "22023", "idem.claim: key must not be empty"},
		{"blank key", `SELECT * FROM idem.claim('s', '   ')`, nil, "22023", "idem.claim: key must not be empty"},
		{"source too long", `SELECT * FROM idem.claim($1, 'k')`, []any{long(65)}, "22001", "idem.claim: source is longer than 64 bytes"},
		{"source too long in bytes", `SELECT * FROM idem.claim($1, 'k')`, []any{strings.Repeat("é", 33)}, "22001", "idem.claim: source is longer than 64 bytes"},
		{"key too long", `SELECT * FROM idem.claim('s', $1)`, []any{long(513)}, "22001", "idem.claim: key is longer than 512 bytes"},
		{"fingerprint too long", `SELECT * FROM idem.claim('s', 'k2', fingerprint => $1)`, []any{long(513)}, "22001", "idem.claim: fingerprint is longer than 512 bytes"},
		{"event type too long", `SELECT * FROM idem.claim('s', 'k2', event_type => $1)`, []any{long(257)}, "22001", "idem.claim: event_type is longer than 256 bytes"},
		{"zero ttl", `SELECT * FROM idem.claim('s', 'k2', ttl => '0')`, nil, "22023", "idem.claim: ttl 00:00:00 is out of range"},
		{"negative ttl", `SELECT * FROM idem.claim('s', 'k2', ttl => '-1 day')`, nil, "22023", "idem.claim: ttl -1 days is out of range"},
		{"absurd ttl", `SELECT * FROM idem.claim('s', 'k2', ttl => '100 years')`, nil, "22023", "idem.claim: ttl 100 years is out of range"},
		{"zero lease", `SELECT * FROM idem.claim('s', 'k2', lease => '0')`, nil, "22023", "idem.claim: lease 00:00:00 is out of range"},
		{"negative lease", `SELECT * FROM idem.claim('s', 'k2', lease => '-5 seconds')`, nil, "22023", "idem.claim: lease -00:00:05 is out of range"},
		{"absurd lease", `SELECT * FROM idem.claim('s', 'k2', lease => '30 days')`, nil, "22023", "idem.claim: lease 30 days is out of range"},
		{"lease over ttl", `SELECT * FROM idem.claim('s', 'k2', ttl => '2 minutes', lease => '1 hour')`, nil, "22023", "idem.claim: lease 01:00:00 is longer than ttl 00:02:00"},
		{"result not json", `SELECT idem.complete('s', 'k', $1, $2::text::jsonb)`, []any{token, "{not json"}, "22P02", "invalid input syntax for type json"},
		{"result too large", `SELECT idem.complete('s', 'k', $1, jsonb_build_object('blob', repeat('x', 1100000)))`, []any{token}, "54000", "idem.complete: result is "},
		{"complete null token", `SELECT idem.complete('s', 'k', NULL)`, nil, "22004", "idem.complete: token must not be NULL"},
		{"complete empty key", `SELECT idem.complete('s', '', 1)`, nil, "22023", "idem.complete: key must not be empty"},
		{"fail null token", `SELECT idem.fail('s', 'k', NULL, 'x')`, nil, "22004", "idem.fail: token must not be NULL"},
		{"fail null source", `SELECT idem.fail(NULL, 'k', 1, 'x')`, nil, "22004", "idem.fail: source must not be NULL"},
		{"extend bad lease", `SELECT * FROM idem.extend('s', 'k', $1, '-1 second')`, []any{token}, "22023", "idem.extend: lease -00:00:01 is out of range"},
		{"extend null key", `SELECT * FROM idem.extend('s', NULL, 1)`, nil, "22004", "idem.extend: key must not be NULL"},
		{"partition for NULL month", `SELECT idem.create_partition(NULL)`, nil, "22004", "idem.create_partition: month must not be NULL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := pool.Exec(ctx, tc.sql, tc.args...)
			var pg *pgconn.PgError
			if !errors.As(err, &pg) {
				t.Fatalf("got %v, want SQLSTATE %s", err, tc.code)
			}
			if pg.Code != tc.code || !strings.HasPrefix(pg.Message, tc.msg) {
				t.Fatalf("got %s %q, want %s %q...", pg.Code, pg.Message, tc.code, tc.msg)
			}
		})
	}
	// Nothing was stored half-way.
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM idem.processed_events`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d rows after the bad inputs (%v), want only the one live row", n, err)
	}

	t.Run("unknown policy", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if _, err := tx.Exec(ctx, `DELETE FROM idem.policies WHERE source = '*'`); err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, `SELECT * FROM idem.claim('nobody', 'k')`)
		var pg *pgconn.PgError
		if !errors.As(err, &pg) || pg.Code != "42704" || pg.Message != `idem.claim: no policy for source 'nobody' and no default policy` {
			t.Fatalf("claim without any policy: %v", err)
		}
	})
	t.Run("policy limits", func(t *testing.T) {
		for _, bad := range []string{
			`INSERT INTO idem.policies (source, ttl, lease) VALUES ('a', '10 seconds', '1 second')`,
			`INSERT INTO idem.policies (source, ttl, lease) VALUES ('b', '1 day', '0')`,
			`INSERT INTO idem.policies (source, ttl, lease) VALUES ('c', '1 hour', '2 hours')`,
			`INSERT INTO idem.policies (source, ttl, lease) VALUES ('', '1 day', '1 minute')`,
		} {
			_, err := pool.Exec(ctx, bad)
			var pg *pgconn.PgError
			if !errors.As(err, &pg) || pg.Code != "23514" {
				t.Errorf("%s: %v, want check_violation 23514", bad, err)
			}
		}
	})
}

// TestBadInputGo checks that the Go API maps every bad input to a sentinel
// without a round trip where PostgreSQL could not even receive the value.
func TestBadInputGo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, c := setup(t)
	cases := []struct {
		name string
		call func() error
		want error
		code string
	}{
		{"empty source", func() error { _, err := c.Claim(ctx, "", "k"); return err }, idem.ErrInvalidInput, "22023"},
		{"blank key", func() error { _, err := c.Claim(ctx, "s", " \t"); return err }, idem.ErrInvalidInput, "22023"},
		{"oversized key", func() error { _, err := c.Claim(ctx, "s", strings.Repeat("k", 600)); return err }, idem.ErrInvalidInput, "22001"},
		{"NUL in key", func() error { _, err := c.Claim(ctx, "s", "a\x00b"); return err }, idem.ErrInvalidInput, ""},
		{"invalid UTF-8 source", func() error { _, err := c.Claim(ctx, "s\xff", "k"); return err }, idem.ErrInvalidInput, ""},
		{"NUL in fingerprint", func() error { _, err := c.Claim(ctx, "s", "k", idem.WithFingerprint("\x00")); return err }, idem.ErrInvalidInput, ""},
		{"negative ttl", func() error { _, err := c.Claim(ctx, "s", "k", idem.WithTTL(-time.Hour)); return err }, idem.ErrInvalidInput, "22023"},
		{"sub-millisecond lease", func() error { _, err := c.Claim(ctx, "s", "k", idem.WithLease(time.Microsecond)); return err }, idem.ErrInvalidInput, "22023"},
		{"result not JSON", func() error { return c.Complete(ctx, "s", "k", 1, []byte("{nope")) }, idem.ErrInvalidInput, ""},
		{"result too large", func() error {
			return c.Complete(ctx, "s", "k", 1, []byte(`"`+strings.Repeat("x", 1<<20+10)+`"`))
		}, idem.ErrResultTooLarge, "54000"},
		{"unknown key", func() error { return c.Complete(ctx, "s", "never", 1, nil) }, idem.ErrNotFound, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if !errors.Is(err, tc.want) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			var ie *idem.Error
			if !errors.As(err, &ie) {
				t.Fatalf("%v is not an *idem.Error", err)
			}
			if ie.SQLState() != tc.code {
				t.Fatalf("SQLSTATE %q, want %q", ie.SQLState(), tc.code)
			}
		})
	}
}

// TestLongKeyNotEchoed: an oversized key (600 bytes, or a multi-byte one)
// is refused with an error that quotes a short prefix and its length,
// never the whole key.
func TestLongKeyNotEchoed(t *testing.T) {
	t.Parallel()
	pool, _ := setup(t)
	c, err := idem.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{strings.Repeat("k", 600), strings.Repeat("é", 300)} {
		_, err := c.Claim(context.Background(), "s", key)
		if !errors.Is(err, idem.ErrInvalidInput) {
			t.Fatalf("claim of a %d-byte key: %v", len(key), err)
		}
		msg := err.Error()
		if len(msg) > 200 || strings.Contains(msg, key[:100]) || !strings.Contains(msg, "(600 bytes)") {
			t.Fatalf("the error echoes the key: %d bytes: %s", len(msg), msg)
		}
	}
	if got := idem.Quote("short"); got != "short" {
		t.Fatalf("Quote(short) = %q", got)
	}
}
