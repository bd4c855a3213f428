#!/usr/bin/env bash
# The conformance suite (tests/conformance) against a local cluster (issue 21: "server A
# creates, server B execs and reads files, server A deletes"): `scripts/cluster.sh up DIR 1
# --postgres --servers 2` (3 etcd members, PostgreSQL, two `sandlot server`s, one `sandlot
# node` in its own network namespace), then pytest with SANDLOT_CONFORMANCE_CLUSTER=DIR:
# creates and deletes through server A, everything else through server B
# (tests/conformance/conftest.py `SplitClient`), on the cases of `CLUSTER_CASES`
# (function, container-runc; microvm and vm boot under TCG here: too slow for CI), which
# must run (SANDLOT_REQUIRE_BACKENDS). Then `cluster.sh down DIR`.
#
#   scripts/conformance-cluster.sh [PYTEST ARGS...]
#
# Environment: SANDLOT_BIN, SANDLOT_IMAGES_DIR (as scripts/test.sh sets them), PYTHON
# (default .venv/bin/python). Needs root, etcd and PostgreSQL (scripts/setup.sh installs
# both); without them it prints SKIPPED and the reason, and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
# The same search as scripts/postgres.sh: $PG_BIN, else the newest Debian PostgreSQL.
pg_bin=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)}
if [ "$(id -u)" != 0 ]; then echo "SKIPPED: conformance against a cluster needs root"; exit 0; fi
if ! command -v etcd >/dev/null; then echo "SKIPPED: conformance against a cluster: no etcd"; exit 0; fi
if [ ! -x "$pg_bin/postgres" ]; then echo "SKIPPED: conformance against a cluster: no PostgreSQL at $pg_bin"; exit 0; fi

dir=$(mktemp -d /var/tmp/sandlot-ccl-XXXXXX)
logs=${SANDLOT_E2E_LOG_DIR:-$dir.logs}
mkdir -p "$logs"
down() {
  scripts/cluster.sh down "$dir" || echo "conformance-cluster.sh: cluster.sh down failed" >&2
  cp "$dir"/*.log "$logs"/ 2>/dev/null || true
  rm -rf "$dir"
}
trap down EXIT
t0=$SECONDS
scripts/cluster.sh up "$dir" 1 --postgres --servers 2
echo "(cluster up in $((SECONDS - t0)) s; logs kept in $logs)"
SANDLOT_CONFORMANCE_CLUSTER=$dir SANDLOT_REQUIRE_BACKENDS=function,container-runc \
  "$py" -m pytest -q -rfE tests/conformance "$@"
