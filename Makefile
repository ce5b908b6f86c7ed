# idem: the two commands that matter are `make demo` (quick start) and
# `make test` (what CI runs). Everything runs against a real PostgreSQL; the
# test harness starts a throwaway one when IDEM_TEST_DATABASE_URL is unset.

SQLC := GOWORK=off go tool -modfile=tools/go.mod sqlc

.PHONY: test vet generate sqlc-check schema schema-check migration fuzz soak bench build ci

# The README's test command: what the tests need besides Go is checked
# (installed with apt-get when root, else named) before any test runs.
test:
	bash scripts/prereqs
	go test work

vet:
	go vet work

build:
	go build -o bin/idemctl ./cmd/idemctl

# Regenerate db/ from sql/queries and sql/migrations with the pinned sqlc,
# and the sqlc recipe's examples/sqlc-app/appdb.
generate:
	$(SQLC) generate
	$(SQLC) generate -f examples/sqlc-app/sqlc.yaml

# Fails when the committed generated code differs from what sqlc would
# generate.
sqlc-check:
	$(SQLC) diff
	$(SQLC) diff -f examples/sqlc-app/sqlc.yaml

# Regenerate sql/schema/ (schema idem as the migrations leave it, one file
# per object) from a throwaway PostgreSQL migrated to the latest version.
# Run it after adding a migration, and commit the result.
schema:
	go run ./internal/schemagen

# Fails when the committed sql/schema/ differs from what the migrations
# produce (the message lists the files and says to run `make schema`).
schema-check:
	go run ./internal/schemagen -check

# Start the next migration from today's definitions of the objects named:
# make migration NAME=claim_wait OBJECTS="idem.claim idem.complete"
# (docs/contributing.md: the rest of the steps).
migration:
	@test -n "$(NAME)" -a -n "$(OBJECTS)" || { echo 'usage: make migration NAME=short_name OBJECTS="idem.claim ..."'; exit 2; }
	go run ./internal/newmigration $(NAME) $(OBJECTS)

# Each fuzz target briefly; FUZZTIME=5m for a longer run.
FUZZTIME ?= 10s
fuzz:
	go test -run '^$$' -fuzz '^FuzzHashKey$$' -fuzztime $(FUZZTIME) .
	go test -run '^$$' -fuzz '^FuzzClaimInput$$' -fuzztime $(FUZZTIME) .
	go test -run '^$$' -fuzz '^FuzzCompositeKeys$$' -fuzztime $(FUZZTIME) .
	go test -run '^$$' -fuzz '^FuzzStorable$$' -fuzztime $(FUZZTIME) .
	go test -run '^$$' -fuzz '^FuzzInboxOutcomes$$' -fuzztime $(FUZZTIME) ./inbox
	go test -run '^$$' -fuzz '^FuzzIdempotencyKeyHeader$$' -fuzztime $(FUZZTIME) ./idemhttp

# The long reliability run (docs/reliability.md): 50,000 keys x 16, five
# server restarts, 5,000 crashed keys.
soak:
	IDEM_SOAK=1 go test -count=1 -v -timeout 60m -run 'TestDuplicateStorm|TestCrashMidWork|TestServerRestart|TestSenderHangsUpMidHandler|TestRecordingFailures|TestClockSkew|TestDuplicateBehindOpenTransaction' ./internal/reliability

# The benchmark suite (docs/performance.md); BENCHFLAGS=-full for the full sizes.
# Opt-in sections run only when named: BENCHFLAGS="-only ceiling", "-only profile",
# "-only upgrade", "-only year", "-only layout" (issue 56's retention layouts).
bench:
	go run ./bench $(BENCHFLAGS)

ci:
	CI=true bash .ci/run
