#!/bin/bash
# A loopback Citus cluster for the opt-in suite and bench/citus.sh (docs/citus.md):
# a coordinator on 127.0.0.1:9700 and workers on 9701 and 9702, database idem on each
# with the citus extension, the workers added. Data under $CITUS_DIR (default
# /tmp/idem-citus), never in the repository; fsync off (a bench and test cluster).
#
#   bash bench/citus-cluster.sh start   # initdb (first time), start, create idem, add workers
#   bash bench/citus-cluster.sh stop    # stop the three servers (the data stays)
#   bash bench/citus-cluster.sh clean   # stop and remove the data
#
# Needs PostgreSQL 15's server (/usr/lib/postgresql/15/bin) and Citus installed into it
# (docs/citus.md, "Install Citus"). Run as root (the servers run as user postgres) or as
# the user that should own the servers.
set -e
DIR=${CITUS_DIR:-/tmp/idem-citus}
BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
PORTS="9700 9701 9702"
as() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }
P() { psql -h 127.0.0.1 -U postgres -v ON_ERROR_STOP=1 -qAt "$@"; }

case "${1:-start}" in
start)
  mkdir -p "$DIR"
  [ "$(id -u)" = 0 ] && chown postgres "$DIR"
  for p in $PORTS; do
    d=$DIR/$p
    if [ ! -f "$d/PG_VERSION" ]; then
      as "$BIN/initdb" -D "$d" -U postgres --auth=trust >/dev/null
      cat >>"$d/postgresql.conf" <<EOF
port = $p
listen_addresses = '127.0.0.1'
unix_socket_directories = '$DIR'
shared_preload_libraries = 'citus,pg_stat_statements'
max_prepared_transactions = 200
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 128MB
track_functions = 'pl'
EOF
    fi
    as "$BIN/pg_ctl" -D "$d" -l "$d/log" -w status >/dev/null 2>&1 || as "$BIN/pg_ctl" -D "$d" -l "$d/log" -w start >/dev/null
  done
  for p in $PORTS; do
    if [ "$(P -p $p -d postgres -c "SELECT count(*) FROM pg_database WHERE datname = 'idem'")" = 0 ]; then
      P -p $p -d postgres -c "CREATE DATABASE idem"
    fi
    # Only where missing: once a worker is added, Citus refuses CREATE EXTENSION there,
    # IF NOT EXISTS or not ("operation is not allowed on this node"), so a second start failed.
    for e in citus pg_stat_statements; do
      if [ "$(P -p $p -d idem -c "SELECT count(*) FROM pg_extension WHERE extname = '$e'")" = 0 ]; then
        P -p $p -d idem -c "CREATE EXTENSION $e"
      fi
    done
  done
  P -p 9700 -d idem -c "SELECT citus_set_coordinator_host('127.0.0.1', 9700)" >/dev/null
  for p in 9701 9702; do
    if [ "$(P -p 9700 -d idem -c "SELECT count(*) FROM pg_dist_node WHERE nodeport = $p")" = 0 ]; then
      P -p 9700 -d idem -c "SELECT citus_add_node('127.0.0.1', $p)" >/dev/null
    fi
  done
  P -p 9700 -d idem -c "SELECT citus_version()"
  P -p 9700 -d idem -c "SELECT nodename || ':' || nodeport FROM pg_dist_node ORDER BY nodeport"
  echo "IDEM_TEST_CITUS_URL=postgres://postgres@127.0.0.1:9700/idem"
  ;;
stop)
  for p in $PORTS; do
    [ -f "$DIR/$p/PG_VERSION" ] && as "$BIN/pg_ctl" -D "$DIR/$p" -w -m fast stop >/dev/null 2>&1 || true
  done
  ;;
clean)
  "$0" stop
  rm -rf "$DIR"
  ;;
*)
  echo "usage: $0 start|stop|clean" >&2
  exit 2
  ;;
esac
