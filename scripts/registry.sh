#!/usr/bin/env bash
# The local OCI registry the image tests pull from: Debian's `docker-registry` (the CNCF
# distribution registry 2.8) serving plain HTTP on 127.0.0.1:5000 with its own config file,
# storage under /var/lib/sandlot/registry. No systemd needed; nothing comes from the internet.
#
#   scripts/registry.sh start   start it unless a registry already answers (idempotent)
#   scripts/registry.sh stop    stop the one this script started (pid file)
#   scripts/registry.sh status  exit 0 when a registry answers on the address
#   scripts/registry.sh push    push the store's busybox and python images as OCI images
#                               127.0.0.1:5000/sandlot/{busybox,python}:latest (built with
#                               umoci, copied with skopeo); skipped when already there
#                               unless FORCE=1
#
# Environment: SANDLOT_REGISTRY_ADDR (127.0.0.1:5000), SANDLOT_REGISTRY_DIR
# (/var/lib/sandlot/registry), SANDLOT_IMAGES_DIR (/var/lib/sandlot/images).
set -euo pipefail

ADDR="${SANDLOT_REGISTRY_ADDR:-127.0.0.1:5000}"
DIR="${SANDLOT_REGISTRY_DIR:-/var/lib/sandlot/registry}"
IMAGES="${SANDLOT_IMAGES_DIR:-/var/lib/sandlot/images}"
CONF="$DIR/config.yml"
PIDF="$DIR/registry.pid"
LOG="$DIR/registry.log"

answers() { curl -fsS -m 2 -o /dev/null "http://$ADDR/v2/" 2>/dev/null; }

start() {
  if answers; then
    echo "registry: already answering on $ADDR"
    return 0
  fi
  command -v docker-registry >/dev/null || {
    echo "registry: docker-registry missing (apt-get install docker-registry)" >&2
    exit 1
  }
  mkdir -p "$DIR/storage"
  cat >"$CONF" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $DIR/storage
  delete:
    enabled: true
http:
  addr: $ADDR
EOF
  # setsid + nohup: the registry outlives this script and the setup that called it.
  setsid nohup docker-registry serve "$CONF" >>"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDF"
  for _ in $(seq 1 100); do
    if answers; then
      echo "registry: started on $ADDR (pid $(cat "$PIDF"), log $LOG)"
      return 0
    fi
    sleep 0.1
  done
  echo "registry: did not answer on $ADDR within 10 s; tail of $LOG:" >&2
  tail -20 "$LOG" >&2 || true
  exit 1
}

stop() {
  if [ -f "$PIDF" ] && kill -0 "$(cat "$PIDF")" 2>/dev/null; then
    kill "$(cat "$PIDF")"
    rm -f "$PIDF"
    echo "registry: stopped"
  else
    echo "registry: not started by this script"
  fi
}

# push NAME ENV...: the store image NAME (one rootfs layer) → 127.0.0.1:5000/sandlot/NAME:latest
push_one() {
  local name="$1"
  shift
  local dest="docker://$ADDR/sandlot/$name:latest"
  if [ "${FORCE:-0}" != 1 ] && skopeo inspect --tls-verify=false "$dest" >/dev/null 2>&1; then
    echo "registry: $ADDR/sandlot/$name:latest already present"
    return 0
  fi
  local rootfs="$IMAGES/$name/rootfs"
  [ -d "$rootfs" ] || { echo "registry: $rootfs missing (sandlot image build $name)" >&2; exit 1; }
  local work
  work="$(mktemp -d)"
  umoci init --layout "$work/oci"
  umoci new --image "$work/oci:latest"
  # One layer with the whole rootfs (umoci insert writes a gzip tar layer).
  umoci insert --image "$work/oci:latest" "$rootfs" /
  local args=()
  for kv in "$@"; do args+=(--config.env "$kv"); done
  umoci config --image "$work/oci:latest" --config.workingdir /workspace "${args[@]}" \
    --architecture amd64 --os linux
  skopeo copy --quiet --dest-tls-verify=false "oci:$work/oci:latest" "$dest"
  rm -rf "$work"
  echo "registry: pushed $ADDR/sandlot/$name:latest"
}

push() {
  answers || { echo "registry: nothing answers on $ADDR (scripts/registry.sh start)" >&2; exit 1; }
  local path="PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
  push_one busybox "$path"
  push_one python "$path" "LANG=C.UTF-8"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) answers ;;
  push) push ;;
  *) echo "usage: $0 start|stop|status|push" >&2; exit 2 ;;
esac
