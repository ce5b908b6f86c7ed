#!/bin/bash
# Claims of new keys on one PostgreSQL and on Citus with 1 and 2 workers (docs/citus.md,
# "Throughput by node count"): per installation, claims per second through pgbench
# (bench/pgbench/claim_new_param.sql, -M prepared) and the CPU each node's servers spent
# per claim (from /proc: Linux, and the cluster's servers on this machine), so that the
# price of a delegated claim reads the same on a loaded machine as on a quiet one.
# Needs the loopback cluster of bench/citus-cluster.sh (coordinator 127.0.0.1:9700,
# workers 9701 and 9702, data under $CITUS_DIR, default /tmp/idem-citus).
#
#   bash bench/citus-cluster.sh start && bash bench/citus.sh [seconds] [rounds]
set -e
cd "$(dirname "$0")/.."
T=${1:-20}
ROUNDS=${2:-2}
DIR=${CITUS_DIR:-/tmp/idem-citus}
P="psql -h 127.0.0.1 -U postgres -q"

# node_ticks port: CPU ticks (user + system) of the server on port and its children,
# those that exited included.
node_ticks() {
  local t=0 pm p
  pm=$(head -1 "$DIR/$1/postmaster.pid")
  for p in $pm $(ps -o pid= --ppid "$pm"); do
    if [ -r /proc/$p/stat ]; then
      set -- $(sed 's/.*) //' /proc/$p/stat)
      t=$((t + ${12} + ${13}))
      [ "$p" = "$pm" ] && t=$((t + ${14} + ${15}))
    fi
  done
  echo $t
}

# measure db label calls... : runs the rest of the line, which prints its count of calls
# (pgbench's transactions, or citusbatch's keys), and prints the rate and the CPU ms per
# call (a key) by node.
measure() {
  local db=$1 label=$2 a0 a1 a2 b0 b1 b2 out n rate hz
  shift 2
  hz=$(getconf CLK_TCK)
  a0=$(node_ticks 9700); a1=$(node_ticks 9701); a2=$(node_ticks 9702)
  out=$("$@" 2>&1) || { echo "$out" >&2; return 1; }
  b0=$(node_ticks 9700); b1=$(node_ticks 9701); b2=$(node_ticks 9702)
  n=$(echo "$out" | awk '/number of transactions actually processed/ {split($NF, a, "/"); print a[1]} /^keys=/ {split($1, a, "="); print a[2]}')
  rate=$(echo "$out" | awk '/^tps/ {print int($3)} /^keys=/ {split($2, a, "="); print a[2]}')
  if [ -z "$n" ] || [ "$n" = 0 ]; then echo "$out" >&2; return 1; fi
  printf '%s %-11s %-16s keys/s=%-6s cpu ms/key: coordinator %.3f  worker1 %.3f  worker2 %.3f  total %.3f\n' \
    "$round" "$db" "$label" "$rate" \
    "$(echo "($b0-$a0)*1000/$hz/$n" | bc -l)" "$(echo "($b1-$a1)*1000/$hz/$n" | bc -l)" \
    "$(echo "($b2-$a2)*1000/$hz/$n" | bc -l)" "$(echo "($b0-$a0+$b1-$a1+$b2-$a2)*1000/$hz/$n" | bc -l)"
}
pgb() { pgbench -n -M prepared -f bench/pgbench/claim_new_param.sql -c "$2" -j 2 -T "$T" -h 127.0.0.1 -p 9700 -U postgres "$1"; }
(cd bench && go build -o /tmp/idem-citusbatch ./citusbatch)
gob() { /tmp/idem-citusbatch -database-url "postgres://postgres@127.0.0.1:9700/$1" -batch "$2" -clients 8 -duration "${T}s"; }

$P -p 9700 -d postgres -c "DROP DATABASE IF EXISTS idem_single WITH (FORCE)" -c "CREATE DATABASE idem_single" 2>/dev/null
go run ./cmd/idemctl migrate up --river=false --database-url postgres://postgres@127.0.0.1:9700/idem_single >/dev/null 2>&1
for w in 1 2; do
  ports="9700 9701"; [ $w = 2 ] && ports="9700 9701 9702"
  for p in $ports; do
    $P -p $p -d postgres -c "DROP DATABASE IF EXISTS idem_w$w WITH (FORCE)" -c "CREATE DATABASE idem_w$w" 2>/dev/null
    $P -p $p -d idem_w$w -c "CREATE EXTENSION citus"
  done
  $P -p 9700 -d idem_w$w -c "SELECT citus_set_coordinator_host('127.0.0.1', 9700)" >/dev/null
  for p in $ports; do [ $p = 9700 ] || $P -p 9700 -d idem_w$w -c "SELECT citus_add_node('127.0.0.1', $p)" >/dev/null; done
  go run ./cmd/idemctl migrate up --citus --river=false --database-url postgres://postgres@127.0.0.1:9700/idem_w$w >/dev/null 2>&1
done
for round in $(seq 1 "$ROUNDS"); do
  for db in idem_single idem_w1 idem_w2; do
    for c in 8 32; do
      measure $db "claim c=$c" pgb $db $c
    done
    measure $db "Claim (Go) c=8" gob $db 1
    measure $db "ClaimBatch 100" gob $db 100
  done
done
