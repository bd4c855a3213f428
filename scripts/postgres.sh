#!/usr/bin/env bash
# A throwaway PostgreSQL server for tests and local clusters (issue 21, cluster mode).
#
#   scripts/postgres.sh start DIR [PORT]   initdb into DIR/data (first time only), start the
#                                           server on 127.0.0.1:PORT (default 55432) with its
#                                           unix socket in DIR, wait until it accepts
#                                           connections, and print one line
#                                           `postgres postgres://sandlot@127.0.0.1:PORT/sandlot`
#   scripts/postgres.sh stop DIR            stop the server started in DIR (fast shutdown);
#                                           removes nothing
#
# Uses Debian's PostgreSQL 15 binaries (/usr/lib/postgresql/15/bin, package `postgresql`,
# installed by scripts/setup.sh), or $PG_BIN. Database `sandlot`, superuser `sandlot`, trust
# authentication on loopback and the socket only: for tests and demos, not production.
# initdb and postgres refuse to run as root, so as root the server runs as the `postgres`
# user (Debian's package creates it) and DIR is chowned to it.
set -euo pipefail

usage() { echo "usage: $0 start DIR [PORT] | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
port=${3:-55432}

bin=${PG_BIN:-}
if [ -z "$bin" ]; then
  for v in 17 16 15; do
    if [ -x "/usr/lib/postgresql/$v/bin/postgres" ]; then bin=/usr/lib/postgresql/$v/bin; break; fi
  done
fi
if [ -z "$bin" ] || [ ! -x "$bin/pg_ctl" ]; then
  echo "postgres.sh: PostgreSQL binaries not found (install Debian's postgresql, or set PG_BIN)" >&2
  exit 3
fi

# Run a command as the server's user: `postgres` when we are root, else ourselves.
as_pg() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

case "$cmd" in
  start)
    if [ "$(id -u)" = 0 ]; then
      id postgres >/dev/null 2>&1 || { echo "postgres.sh: no 'postgres' user to run the server as" >&2; exit 3; }
      chown postgres: "$dir"
      # The server user must be able to reach DIR (a temp dir under a 0700 parent is not).
      chmod 0755 "$dir"
    fi
    if [ ! -f "$dir/data/PG_VERSION" ]; then
      as_pg "$bin/initdb" -D "$dir/data" --username=sandlot --auth=trust --encoding=UTF8 \
        --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 || {
        echo "postgres.sh: initdb failed, see $dir/initdb.log" >&2; tail -5 "$dir/initdb.log" >&2; exit 1; }
    fi
    # Already running from DIR: just report it.
    if as_pg "$bin/pg_ctl" -D "$dir/data" status >/dev/null 2>&1; then
      echo "postgres postgres://sandlot@127.0.0.1:$port/sandlot"
      exit 0
    fi
    # -k: socket in DIR; -h: TCP on loopback only. Settings for a test server: no fsync
    # would be faster, but tests check durability semantics, so keep the defaults.
    as_pg "$bin/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
      -o "-h 127.0.0.1 -p $port -k $dir -c max_connections=200" start >/dev/null || {
      echo "postgres.sh: start failed, see $dir/postgres.log" >&2; tail -5 "$dir/postgres.log" >&2; exit 1; }
    # The `sandlot` database (idempotent).
    if ! as_pg "$bin/psql" -h "$dir" -p "$port" -U sandlot -d postgres -tAc \
        "SELECT 1 FROM pg_database WHERE datname = 'sandlot'" | grep -q 1; then
      as_pg "$bin/createdb" -h "$dir" -p "$port" -U sandlot sandlot
    fi
    echo "postgres postgres://sandlot@127.0.0.1:$port/sandlot"
    ;;
  stop)
    if [ -f "$dir/data/postmaster.pid" ]; then
      as_pg "$bin/pg_ctl" -D "$dir/data" -m fast -w -t 60 stop >/dev/null
    fi
    ;;
  *) usage ;;
esac
