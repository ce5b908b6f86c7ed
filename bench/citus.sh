#!/bin/bash
# Claims per second of new keys (pgbench, bench/pgbench/claim_new_param.sql) on one
# PostgreSQL and on Citus with 1 and 2 workers: docs/citus.md. Needs a loopback Citus
# cluster: a coordinator on 127.0.0.1:9700 and workers on 9701 and 9702 (user postgres).
set -e
cd "$(dirname "$0")/.."
P="psql -h 127.0.0.1 -U postgres -q"
$P -p 9700 -c "DROP DATABASE IF EXISTS idem_single WITH (FORCE)" -c "CREATE DATABASE idem_single" 2>/dev/null
go run ./cmd/idemctl migrate up --river=false --database-url postgres://postgres@127.0.0.1:9700/idem_single >/dev/null
for p in 9700 9701; do
  $P -p $p -c "DROP DATABASE IF EXISTS idem_w1 WITH (FORCE)" -c "CREATE DATABASE idem_w1" 2>/dev/null
  $P -p $p -d idem_w1 -c "CREATE EXTENSION citus"
done
$P -p 9700 -d idem_w1 -c "SELECT citus_set_coordinator_host('127.0.0.1', 9700)" -c "SELECT citus_add_node('127.0.0.1', 9701)" >/dev/null
go run ./cmd/idemctl migrate up --citus --river=false --database-url postgres://postgres@127.0.0.1:9700/idem_w1 >/dev/null
for p in 9700 9701 9702; do $P -p $p -c "DROP DATABASE IF EXISTS idem_w2 WITH (FORCE)" -c "CREATE DATABASE idem_w2" 2>/dev/null; $P -p $p -d idem_w2 -c "CREATE EXTENSION citus"; done
$P -p 9700 -d idem_w2 -c "SELECT citus_set_coordinator_host('127.0.0.1', 9700)" -c "SELECT citus_add_node('127.0.0.1', 9701)" -c "SELECT citus_add_node('127.0.0.1', 9702)" >/dev/null
go run ./cmd/idemctl migrate up --citus --river=false --database-url postgres://postgres@127.0.0.1:9700/idem_w2 >/dev/null
for round in 1 2; do
for db in idem_single idem_w1 idem_w2; do
  for c in 8 32; do
    tps=$(pgbench -n -M prepared -f bench/pgbench/claim_new_param.sql -c $c -j 2 -T 10 -h 127.0.0.1 -p 9700 -U postgres $db 2>/dev/null | awk '/^tps/ {print int($3)}')
    echo "$round $db clients=$c new-key claims/s=$tps"
  done
done
done
