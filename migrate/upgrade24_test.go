package migrate_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestUpgradeTo24: from version 23 holding data (stored keys, a key in
// progress, two adoptions copying: one of a plain table, one whose key
// column is a domain of another role), the upgrade to 24 keeps every
// answer; the plain adoption goes on and ends, while the one whose read
// would run another role's code is refused, by the copy and by the claims
// that consult it. A duplicate claimed read-only with a ttl above the
// lookback is answered; idem.sampling_key_a and _b hold a secret. Down to 23 and up
// again.
func TestUpgradeTo24(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, db, p := setupAt(t)
	if _, err := p.UpTo(ctx, 23); err != nil {
		t.Fatal(err)
	}
	seedCompleted(t, db)
	role := fmt.Sprintf("up24_app_%d", time.Now().UnixNano()%1e9)
	if _, err := db.ExecContext(ctx, `SELECT idem.claim('up', 'running', lease => '1 hour');
		CREATE ROLE `+role+`;
		CREATE TABLE public.legacy_ok (k text PRIMARY KEY, at timestamptz);
		INSERT INTO public.legacy_ok VALUES ('ok-1', now() - interval '1 hour'), ('ok-2', now());
		CREATE DOMAIN public.up24_key AS text CHECK (VALUE <> '');
		ALTER DOMAIN public.up24_key OWNER TO `+role+`;
		CREATE TABLE public.legacy_bad (k public.up24_key PRIMARY KEY, at timestamptz);
		INSERT INTO public.legacy_bad VALUES ('bad-1', now());
		SELECT idem.adopt_start('ok', 'public.legacy_ok'::regclass, 'k', 'at', NULL, '30 days');
		SELECT idem.adopt_start('bad', 'public.legacy_bad'::regclass, 'k', 'at', NULL, '30 days')`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), `DROP TABLE IF EXISTS public.legacy_bad; DROP DOMAIN IF EXISTS public.up24_key; DROP ROLE IF EXISTS `+role)
	})
	claim := func(source, key string) (string, error) {
		var outcome string
		err := db.QueryRowContext(ctx, `SELECT outcome FROM idem.claim($1, $2)`, source, key).Scan(&outcome)
		return outcome, err
	}
	if got, err := claim("bad", "bad-1"); err != nil || got != "completed" {
		t.Fatalf("version 23, a legacy key of the domain-keyed table: %q %v", got, err)
	}

	if _, err := p.UpTo(ctx, 24); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "after the upgrade to 24")
	if got, err := claim("ok", "ok-1"); err != nil || got != "completed" {
		t.Fatalf("version 24, a legacy key of the plain table while copying: %q %v", got, err)
	}
	var done bool
	if err := db.QueryRowContext(ctx, `SELECT b.done FROM idem.adoptions a, idem.adopt_batch(a.id, 100) b WHERE a.source = 'ok'`).Scan(&done); err != nil || !done {
		t.Fatalf("version 24, the plain table's copy: done %v %v", done, err)
	}
	if got, err := claim("ok", "ok-2"); err != nil || got != "completed" {
		t.Fatalf("version 24, a legacy key of the plain table once adopted: %q %v", got, err)
	}
	for _, q := range []string{
		`SELECT outcome FROM idem.claim('bad', 'bad-new')`,
		`SELECT b.done::text FROM idem.adoptions a, idem.adopt_batch(a.id, 100) b WHERE a.source = 'bad'`,
	} {
		var got string
		err := db.QueryRowContext(ctx, q).Scan(&got)
		if err == nil || !strings.Contains(err.Error(), "would run code of a role that is neither a superuser nor idem's owner") {
			t.Fatalf("version 24, %s on the domain-keyed table: %q %v, want the refusal", q, got, err)
		}
	}
	tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	var ro string
	err = tx.QueryRowContext(ctx, `SELECT outcome FROM idem.claim('up', 'done-1', ttl => '400 days')`).Scan(&ro)
	_ = tx.Rollback()
	if err != nil || ro != "completed" {
		t.Fatalf("version 24, a read-only duplicate with a ttl above the lookback: %q %v", ro, err)
	}
	var secret bool
	if err := db.QueryRowContext(ctx, `SELECT pg_sequence_last_value('idem.sampling_key_a') > 0 AND pg_sequence_last_value('idem.sampling_key_b') > 0
		AND NOT has_sequence_privilege('`+role+`', 'idem.sampling_key_a', 'SELECT, USAGE, UPDATE')`).Scan(&secret); err != nil || !secret {
		t.Fatalf("version 24, idem.sampling_key_a and _b: a secret only the owner reads: %v %v", secret, err)
	}

	if _, err := p.DownTo(ctx, 23); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "down to 23")
	if got, err := claim("bad", "bad-1"); err != nil || got != "completed" {
		t.Fatalf("down to 23, a legacy key of the domain-keyed table: %q %v", got, err)
	}
	if _, err := p.Up(ctx); err != nil {
		t.Fatal(err)
	}
	seededAnswered(t, db, "up again")
}
