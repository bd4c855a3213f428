#!/usr/bin/env bash
# README command 1: set everything up, start `sandlot up` (embedded default: server + node in
# one process, SQLite state), run the main job (HumanEval through run_code), stop the server.
# Extra arguments go to examples/humaneval.py (e.g. --concurrency 4).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

: "${SANDLOT_IMAGES_DIR:=/var/lib/sandlot/images}"
listen="${SANDLOT_LISTEN:-127.0.0.1:7070}"
data_dir="$(mktemp -d /tmp/sandlot-quickstart.XXXXXX)"
log="$data_dir/sandlot-up.log"

printf '\n==> sandlot up --listen %s --data-dir %s\n' "$listen" "$data_dir"
./target/release/sandlot up --listen "$listen" --data-dir "$data_dir" \
  --images-dir "$SANDLOT_IMAGES_DIR" >"$log" 2>&1 &
pid=$!
stop() {
  kill -TERM "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
  # run_code deletes every sandbox it makes; remove the data dir unless one is left.
  if [ -z "$(ls -A "$data_dir/sandboxes" 2>/dev/null)" ]; then rm -rf "$data_dir"; fi
}
trap stop EXIT

export SANDLOT_URL="http://$listen"
for _ in $(seq 1 100); do
  if curl -fsS "$SANDLOT_URL/v1/ping" >/dev/null 2>&1; then break; fi
  if ! kill -0 "$pid" 2>/dev/null; then echo "sandlot up exited:"; cat "$log"; exit 1; fi
  sleep 0.1
done
curl -fsS "$SANDLOT_URL/v1/ping" >/dev/null || { echo "sandlot up did not answer:"; tail -50 "$log"; exit 1; }

printf '\n==> examples/humaneval.py (HumanEval, 164 problems, via POST /run_code)\n'
.venv/bin/python examples/humaneval.py --url "$SANDLOT_URL" "$@"
