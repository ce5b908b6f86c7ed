#!/bin/bash
# Claims of new keys on one PostgreSQL and on Citus with 1 and 2 workers (docs/citus.md,
# "Throughput by node count"): per installation, claims per second through pgbench
# (bench/pgbench/claim_new_param.sql, -M prepared) and the CPU each node's servers spent
# per claim (from /proc: Linux, and the cluster's servers on this machine), so that the
# price of a delegated claim reads the same on a loaded machine as on a quiet one.
# Needs the loopback cluster of bench/citus-cluster.sh (coordinator 127.0.0.1:9700,
# workers 9701 and 9702, data under $CITUS_DIR, default /tmp/idem-citus).
#
#   bash bench/citus-cluster.sh start && bash bench/citus.sh [seconds] [rounds] [warm-up seconds]
#
# DBS (default "idem_single idem_w1 idem_w2") and PATHS (default "claim8 claim32 go batch")
# run a part: e.g. DBS=idem_w1 PATHS="go batch" bash bench/citus.sh 10 3 5.
set -e
cd "$(dirname "$0")/.."
T=${1:-20}      # seconds measured
ROUNDS=${2:-2}
W=${3:-10}      # seconds of warm-up before each measurement
DIR=${CITUS_DIR:-/tmp/idem-citus}
P="psql -h 127.0.0.1 -U postgres -q"

# node_ticks port: CPU ticks (user + system) of the server on port and its children,
# those that exited included.
node_ticks() {
  local t=0 pm p s
  pm=$(head -1 "$DIR/$1/postmaster.pid")
  for p in $pm $(ps -o pid= --ppid "$pm"); do
    s=$(cat /proc/$p/stat 2>/dev/null) || continue   # (a backend that just exited)
    set -- ${s##*) }
    t=$((t + ${12} + ${13}))
    [ "$p" = "$pm" ] && t=$((t + ${14} + ${15}))
  done
  echo $t
}

# measure db label command...: runs the command (its first $W seconds warm the servers'
# plan caches: a claim's copies on the shards are planned once per worker connection) and
# prints the calls per second after the warm-up and the CPU each node spent per call (a key)
# in that window. The command prints its count of calls after the warm-up: pgbench's
# progress lines (-P 1), citusbatch's keys=.
measure() {
  local db=$1 label=$2 a0 a1 a2 b0 b1 b2 out n rate hz pid
  shift 2
  hz=$(getconf CLK_TCK)
  "$@" > /tmp/idem-citus-bench.out 2>&1 &
  pid=$!
  sleep "$W"
  a0=$(node_ticks 9700); a1=$(node_ticks 9701); a2=$(node_ticks 9702)
  wait $pid || { cat /tmp/idem-citus-bench.out >&2; return 1; }
  b0=$(node_ticks 9700); b1=$(node_ticks 9701); b2=$(node_ticks 9702)
  out=$(cat /tmp/idem-citus-bench.out)
  n=$(echo "$out" | awk -v w="$W" '/^progress:/ && $2 + 0 > w {s += $4} /^keys=/ {split($1, a, "="); s = a[2]} END {print int(s)}')
  rate=$((n / T))
  if [ -z "$n" ] || [ "$n" = 0 ]; then echo "$out" >&2; return 1; fi
  printf '%s %-11s %-16s keys/s=%-6s cpu ms/key: coordinator %.3f  worker1 %.3f  worker2 %.3f  total %.3f\n' \
    "$round" "$db" "$label" "$rate" \
    "$(echo "($b0-$a0)*1000/$hz/$n" | bc -l)" "$(echo "($b1-$a1)*1000/$hz/$n" | bc -l)" \
    "$(echo "($b2-$a2)*1000/$hz/$n" | bc -l)" "$(echo "($b0-$a0+$b1-$a1+$b2-$a2)*1000/$hz/$n" | bc -l)"
}
pgb() { pgbench -n -M prepared -P 1 -f bench/pgbench/claim_new_param.sql -c "$2" -j 2 -T $((W + T)) -h 127.0.0.1 -p 9700 -U postgres "$1"; }
(cd bench && go build -o /tmp/idem-citusbatch ./citusbatch)
gob() { /tmp/idem-citusbatch -database-url "postgres://postgres@127.0.0.1:9700/$1" -batch "$2" -clients 8 -warmup "${W}s" -duration "${T}s"; }

DBS=${DBS:-idem_single idem_w1 idem_w2}
PATHS=${PATHS:-claim8 claim32 go batch}
for round in $(seq 1 "$ROUNDS"); do
  for db in $DBS; do
    for p in $PATHS; do
      case $p in
      claim8) measure $db "claim c=8" pgb $db 8 ;;
      claim32) measure $db "claim c=32" pgb $db 32 ;;
      go) measure $db "Claim (Go) c=8" gob $db 1 ;;
      batch) measure $db "ClaimBatch 100" gob $db 100 ;;
      *) echo "citus.sh: unknown path $p (claim8, claim32, go, batch)" >&2; exit 2 ;;
      esac
    done
  done
done
