module github.com/idemkit/idem/internal/failover

go 1.26.7

require (
	github.com/idemkit/idem v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/idemhttp v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/inbox v0.0.0-00010101000000-000000000000
	github.com/jackc/pgx/v5 v5.12.0
	github.com/riverqueue/river v0.51.1
)
