#!/usr/bin/env bash
# A local Sandlot cluster on this host, for tests and demos (docs/operations.md "Cluster mode").
#
#   scripts/cluster.sh up DIR [NODES]   start 3 etcd members, NODES `sandlot node`s (default 3),
#                                       each in its own network namespace with its own data
#                                       dir, and one `sandlot server` in front of them; wait
#                                       until each answers; print one line per component:
#                                         etcd URL
#                                         server URL
#                                         node NAME URL
#   scripts/cluster.sh down DIR         delete every sandbox through the server, stop the
#                                       server, the nodes and etcd, remove the nodes' mounts,
#                                       cgroups and network namespaces and the bridge
#
# Network: a bridge `slcbr0` with SUBNET.1/24 on the host (etcd and the server listen there);
# node I lives in network namespace `slc-nodeI` at SUBNET.(10+I), reached through a veth pair,
# and serves its node API on port 7070. One cluster per host at a time (the bridge name is
# fixed). Processes enter the namespace with `nsenter --net` only (not `ip netns exec`, which
# also remounts /sys and so hides the cgroup file systems from the node).
#
# Registry: the local OCI registry (scripts/registry.sh) listens on the host's loopback
# (SANDLOT_REGISTRY_ADDR, default 127.0.0.1:5000) and image references name it so
# (`127.0.0.1:5000/sandlot/python:latest`, pulled over plain HTTP because the host is a
# loopback address). A node's 127.0.0.1 is its own namespace's, so each node namespace
# DNATs 127.0.0.1:PORT to SUBNET.1:PORT (with route_localnet and SNAT to its own address),
# and the host DNATs SUBNET.1:PORT arriving on the bridge to 127.0.0.1:PORT (route_localnet
# on the bridge; the host rule carries the comment `sandlot-cluster` and `down` removes it).
#
# Environment: SANDLOT_BIN (default target/release/sandlot), SANDLOT_IMAGES_DIR (default
# /var/lib/sandlot/images, shared read-mostly by the nodes), SANDLOT_CLUSTER_SUBNET (first
# three octets, default 10.213.0), SANDLOT_REGISTRY_ADDR (above). Logs: DIR/server.log,
# DIR/nodeI.log, DIR/etcd/mI.log.
#
# What is not here yet (issue 21): PostgreSQL behind several stateless servers (the server
# keeps its records in its own SQLite store under DIR/server, so one server runs).
set -euo pipefail

die() { echo "cluster.sh: $*" >&2; exit 1; }
usage() { sed -n '2,35p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
bin=${SANDLOT_BIN:-$root/target/release/sandlot}
images=${SANDLOT_IMAGES_DIR:-/var/lib/sandlot/images}
subnet=${SANDLOT_CLUSTER_SUBNET:-10.213.0}
bridge=slcbr0
node_port=7070
registry=${SANDLOT_REGISTRY_ADDR:-127.0.0.1:5000}
registry_port=${registry##*:}
registry_rule=(PREROUTING -i "$bridge" -d "$subnet.1" -p tcp --dport "$registry_port"
  -m comment --comment sandlot-cluster -j DNAT --to-destination "$registry")

cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || usage

# wait_http URL [TOKEN] [PID]: poll URL for a 2xx answer, 60 s deadline; stop early when PID exits.
wait_http() {
  local url=$1 token=${2:-} pid=${3:-} deadline=$((SECONDS + 60))
  local -a auth=()
  [ -z "$token" ] || auth=(-H "Authorization: Bearer $token")
  until curl -fsS --max-time 2 "${auth[@]}" "$url" >/dev/null 2>&1; do
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
    [ $SECONDS -lt $deadline ] || return 1
    sleep 0.2
  done
}

# stop_pid FILE: SIGTERM the process in FILE, SIGKILL after 20 s.
stop_pid() {
  local f=$1 pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -TERM "$pid" 2>/dev/null; then
    local deadline=$((SECONDS + 20))
    while kill -0 "$pid" 2>/dev/null; do
      if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; fi
      sleep 0.1
    done
  fi
  rm -f "$f"
}

# remove_cgroups DATA_DIR: kill what is left in the cgroups of the node whose data dir is
# DATA_DIR and remove them, deepest first. Their parent names are the node's
# `default_cgroup_parent` (crates/sandlot-node/src/local.rs: `sandlot-` + 12 hex digits of
# FNV-1a 64 of the absolute path), plus its -ctr, -vm and -q35 siblings.
remove_cgroups() {
  python3 - "$1" <<'EOF'
import glob, os, signal, sys, time
h = 0xcbf29ce484222325
for b in os.path.abspath(sys.argv[1]).encode():
    h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
parent = "sandlot-%012x" % (h & 0xFFFFFFFFFFFF)
tops = [p for s in ("", "-ctr", "-vm", "-q35")
        for p in glob.glob(f"/sys/fs/cgroup/*/{parent}{s}") + glob.glob(f"/sys/fs/cgroup/{parent}{s}")]
dirs = sorted({d for t in tops for d, _, _ in os.walk(t)}, key=len, reverse=True)
for d in dirs:
    try:
        for pid in open(os.path.join(d, "cgroup.procs")).read().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    except OSError:
        pass
for d in dirs:
    for _ in range(50):
        try:
            os.rmdir(d)
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.1)
EOF
}

case "$cmd" in
  up)
    n=${3:-3}
    [[ "$n" =~ ^[1-9][0-9]?$ ]] && [ "$n" -le 50 ] || die "NODES must be 1..50, got '$n'"
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces, the nodes' jails)"
    [ -x "$bin" ] || die "no sandlot binary at $bin (cargo build --release, or set SANDLOT_BIN)"
    command -v nsenter >/dev/null || die "nsenter not found (util-linux)"
    ! ip link show "$bridge" >/dev/null 2>&1 ||
      die "bridge $bridge exists: another cluster is up (scripts/cluster.sh down ITS_DIR)"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    # Containers run as unprivileged host uids that must walk to DIR/nodeI/containers: o+x
    # (not o+r) on DIR, as the node requires of every parent of its data dir.
    chmod o+x "$dir"
    echo "$n" >"$dir/nodes"
    # From here on a failure (or ^C) tears down what was started.
    started=0
    trap '[ "$started" = 1 ] || "$0" down "$dir" >/dev/null 2>&1 || true' EXIT

    ip link add "$bridge" type bridge
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
    if [ "${registry%:*}" = 127.0.0.1 ] && command -v iptables >/dev/null; then
      sysctl -qw "net.ipv4.conf.$bridge.route_localnet=1"
      iptables -t nat -A "${registry_rule[@]}"
    fi

    ETCD_HOST="$subnet.1" "$root/scripts/etcd.sh" start "$dir/etcd" 3 >"$dir/etcd.lines"
    etcd_urls=$("$root/scripts/etcd.sh" urls "$dir/etcd")

    token_file="$dir/node-token"
    (umask 077 && head -c 32 /dev/urandom | base64 >"$token_file")
    token=$(cat "$token_file")

    for ((i = 0; i < n; i++)); do
      ns="slc-node$i" ip_addr="$subnet.$((10 + i))"
      ip netns add "$ns"
      ip link add "slcv$i" type veth peer name eth0 netns "$ns"
      ip link set "slcv$i" master "$bridge" up
      ip -n "$ns" addr add "$ip_addr/24" dev eth0
      ip -n "$ns" link set lo up
      ip -n "$ns" link set eth0 up
      ip -n "$ns" route add default via "$subnet.1"
      if [ "${registry%:*}" = 127.0.0.1 ] && command -v iptables >/dev/null; then
        nsenter --net="/run/netns/$ns" sh -ec "
          sysctl -qw net.ipv4.conf.all.route_localnet=1 net.ipv4.conf.eth0.route_localnet=1
          iptables -t nat -A OUTPUT -d 127.0.0.1 -p tcp --dport $registry_port \\
            -j DNAT --to-destination $subnet.1:$registry_port
          iptables -t nat -A POSTROUTING -o eth0 -s 127.0.0.1 -j SNAT --to-source $ip_addr"
      fi
      url="http://$ip_addr:$node_port"
      setsid nsenter --net="/run/netns/$ns" "$bin" node --listen "$ip_addr:$node_port" \
        --advertise "$url" --etcd "$etcd_urls" --name "node$i" \
        --data-dir "$dir/node$i" --images-dir "$images" --token-file "$token_file" \
        </dev/null >>"$dir/node$i.log" 2>&1 &
      echo $! >"$dir/node$i.pid"
    done
    for ((i = 0; i < n; i++)); do
      url="http://$subnet.$((10 + i)):$node_port"
      wait_http "$url/v1/info" "$token" "$(cat "$dir/node$i.pid")" ||
        { tail -n 20 "$dir/node$i.log" >&2; die "node$i did not answer at $url"; }
    done

    port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    server_url="http://127.0.0.1:$port"
    setsid "$bin" server --listen "127.0.0.1:$port" --etcd "$etcd_urls" \
      --node-token-file "$token_file" --data-dir "$dir/server" --images-dir "$images" \
      </dev/null >>"$dir/server.log" 2>&1 &
    echo $! >"$dir/server.pid"
    echo "$server_url" >"$dir/server.url"
    wait_http "$server_url/v1/ping" "" "$(cat "$dir/server.pid")" ||
      { tail -n 20 "$dir/server.log" >&2; die "the server did not answer at $server_url"; }

    started=1
    cat "$dir/etcd.lines"
    echo "server $server_url"
    for ((i = 0; i < n; i++)); do echo "node node$i http://$subnet.$((10 + i)):$node_port"; done
    ;;
  down)
    [ -d "$dir" ] || exit 0
    dir=$(cd "$dir" && pwd)
    n=$(cat "$dir/nodes" 2>/dev/null || echo 0)
    # Sandboxes first, while the server and the nodes still run: their jails, mounts and
    # cgroups go the normal way.
    if [ -f "$dir/server.pid" ] && kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then
      python3 - "$(cat "$dir/server.url")" <<'EOF' || echo "cluster.sh: deleting sandboxes failed; cleaning up below" >&2
import json, sys, urllib.request
url = sys.argv[1]
with urllib.request.urlopen(url + "/v1/sandboxes", timeout=30) as r:
    body = json.load(r)
items = body.get("sandboxes", body) if isinstance(body, dict) else body
for sb in items:
    req = urllib.request.Request(f"{url}/v1/sandboxes/{sb['id']}", method="DELETE")
    try:
        urllib.request.urlopen(req, timeout=60).close()
    except Exception as e:  # one failure must not keep the rest alive
        print(f"cluster.sh: delete {sb['id']}: {e}", file=sys.stderr)
EOF
    fi
    stop_pid "$dir/server.pid"
    for ((i = 0; i < n; i++)); do stop_pid "$dir/node$i.pid"; done
    [ ! -d "$dir/etcd" ] || "$root/scripts/etcd.sh" stop "$dir/etcd"
    # What a node killed mid-way left behind: mounts under DIR (deepest first) and the
    # cgroups of the nodes' data dirs.
    awk -v d="$dir/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r |
      while read -r m; do umount -l "$m" 2>/dev/null || true; done
    for ((i = 0; i < n; i++)); do
      [ ! -d "$dir/node$i" ] || remove_cgroups "$dir/node$i"
      ip netns del "slc-node$i" 2>/dev/null || true
    done
    ip link del "$bridge" 2>/dev/null || true
    # The registry forward on the host, whatever SANDLOT_REGISTRY_ADDR was at `up`.
    if command -v iptables >/dev/null; then
      iptables -t nat -S PREROUTING | grep -- '--comment sandlot-cluster' | sed 's/^-A //' |
        while read -r rule; do eval "iptables -t nat -D $rule" || true; done || true
    fi
    ;;
  *) usage ;;
esac
