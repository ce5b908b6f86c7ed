-- The application's queries, calling idem's functions. Cast every column
-- of a set-returning function (sqlc cannot see their types otherwise) and
-- every argument (so the generated parameters are typed).

-- name: ClaimDelivery :one
-- Claim a delivery with the source's policy; lease_ms NULL: the policy's.
SELECT c.outcome::text                 AS outcome,
       coalesce(c.token, 0)::bigint    AS token,
       coalesce(c.attempt, 0)::integer AS attempt,
       c.result::jsonb                 AS result
  FROM idem.claim(sqlc.arg(source)::text, sqlc.arg(key)::text,
                  fingerprint => sqlc.narg(fingerprint)::text,
                  lease => sqlc.narg(lease_ms)::bigint * interval '1 millisecond') AS c;

-- name: CreateOrder :exec
INSERT INTO orders (order_id, customer, total_cents) VALUES ($1, $2, $3);

-- name: CompleteDelivery :one
SELECT idem.complete(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                     sqlc.arg(result)::jsonb)::text AS outcome;

-- name: FailDelivery :one
SELECT idem.fail(sqlc.arg(source)::text, sqlc.arg(key)::text, sqlc.arg(token)::bigint,
                 sqlc.arg(error)::text, sqlc.arg(retryable)::boolean)::text AS outcome;

-- name: OrdersByCustomer :one
SELECT count(*)::bigint AS orders, coalesce(sum(total_cents), 0)::bigint AS cents
  FROM orders WHERE customer = $1;
