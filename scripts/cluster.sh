#!/usr/bin/env bash
# A local Sandlot cluster on this host, for tests and demos (docs/operations.md "Cluster mode").
#
#   scripts/cluster.sh up DIR [NODES] [--postgres] [--servers K]
#                                       start 3 etcd members, NODES `sandlot node`s (default 3),
#                                       each in its own network namespace with its own data
#                                       dir, and K `sandlot server`s (default 1) in front of
#                                       them; wait until each answers; print one line per
#                                       component, in this order:
#                                         etcd URL            (3 lines)
#                                         postgres URL        (with --postgres)
#                                         server URL          (K lines)
#                                         node NAME URL       (NODES lines)
#                                       --postgres: PostgreSQL (scripts/postgres.sh, data in
#                                       DIR/pg) holds the servers' records (`sandlot server
#                                       --postgres`) instead of each server's own SQLite store;
#                                       K > 1 needs it (and implies it): the servers share the
#                                       database and elect the one that runs the singletons.
#   scripts/cluster.sh node-start DIR I start node I (0-based) again after it was killed: the
#                                       same command line (namespace, data dir, name, flags);
#                                       wait until it answers; print its `node NAME URL` line
#   scripts/cluster.sh server-start DIR I
#                                       start server I (0-based) again after it was killed:
#                                       the same command line (port, name, data dir, flags);
#                                       wait until it answers; print its `server URL` line
#   scripts/cluster.sh down DIR         delete every sandbox through a server, stop the servers,
#                                       the nodes, etcd and PostgreSQL, remove the nodes' mounts,
#                                       cgroups and network namespaces and the bridge
#
# Network: a bridge `slcbr0` with SUBNET.1/24 on the host (etcd and the servers listen there);
# node I lives in network namespace `slc-nodeI` at SUBNET.(10+I), reached through a veth pair
# (host end `slcvI`), and serves its node API on port 7070. One cluster per host at a time
# (the bridge name is fixed). Processes enter the namespace with `nsenter --net` only (not
# `ip netns exec`, which also remounts /sys and so hides the cgroup file systems from the node).
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
# three octets, default 10.213.0), SANDLOT_REGISTRY_ADDR (above); SANDLOT_CLUSTER_POSTGRES=1
# and SANDLOT_CLUSTER_SERVERS=K (same as the flags); SANDLOT_CLUSTER_NODE_ARGS and
# SANDLOT_CLUSTER_SERVER_ARGS: extra flags, split on spaces, appended to every `sandlot node`
# and `sandlot server` command line (tests pass short `--lease-ttl-s`/`--election-ttl-s`
# and `--warm-pool 0` this way). Server I (0-based) is named `srvI` (`--name`), keeps its
# state in DIR/server (I = 0) or DIR/serverI, and its pid, URL, command line and log in
# DIR/server.{pid,url,cmd,log} (I = 0) or DIR/serverI.{pid,url,cmd,log}. Logs: also DIR/nodeI.log,
# DIR/etcd/mI.log, DIR/pg/postgres.log. Every node gets `--snapshot-dir DIR/snapshots`, the
# shared snapshot store (one directory of this host, as an NFS mount would be on several),
# so a paused microVM or VM resumes on another node when its own is gone.
set -euo pipefail

die() { echo "cluster.sh: $*" >&2; exit 1; }
usage() { sed -n '2,56p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

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

# start_node DIR I: run node I's command line (DIR/nodeI.cmd, written by `up`) in the
# background, in its own session, appending to DIR/nodeI.log; its pid goes to DIR/nodeI.pid
# (nsenter execs the node, so that is the node's pid).
start_node() {
  local -a argv
  mapfile -d '' -t argv <"$1/node$2.cmd"
  setsid "${argv[@]}" </dev/null >>"$1/node$2.log" 2>&1 &
  echo $! >"$1/node$2.pid"
}

# server_stem DIR I: DIR/server for server 0, DIR/serverI for the others (pid, url, log, data).
server_stem() { if [ "$2" = 0 ]; then echo "$1/server"; else echo "$1/server$2"; fi; }

# start_server STEM: run the server command line STEM.cmd (written by `up`) in the
# background, in its own session, appending to STEM.log; its pid goes to STEM.pid.
start_server() {
  local -a argv
  mapfile -d '' -t argv <"$1.cmd"
  setsid "${argv[@]}" </dev/null >>"$1.log" 2>&1 &
  echo $! >"$1.pid"
}

case "$cmd" in
  up)
    shift 2
    n=3 postgres=${SANDLOT_CLUSTER_POSTGRES:-0} servers=${SANDLOT_CLUSTER_SERVERS:-1}
    while [ $# -gt 0 ]; do
      case "$1" in
        --postgres) postgres=1 ;;
        --servers) [ $# -ge 2 ] || die "--servers needs a count"; servers=$2; shift ;;
        --servers=*) servers=${1#--servers=} ;;
        -*) die "unknown flag $1" ;;
        *) n=$1 ;;
      esac
      shift
    done
    [[ "$servers" =~ ^[1-9]$ ]] || die "--servers must be 1..9, got '$servers'"
    [ "$servers" = 1 ] || postgres=1
    [ "$postgres" = 0 ] || [ "$postgres" = 1 ] || die "SANDLOT_CLUSTER_POSTGRES must be 0 or 1"
    read -r -a node_extra <<<"${SANDLOT_CLUSTER_NODE_ARGS:-}"
    read -r -a server_extra <<<"${SANDLOT_CLUSTER_SERVER_ARGS:-}"
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
    echo "$servers" >"$dir/servers"
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

    pg_args=()
    if [ "$postgres" = 1 ]; then
      pg_port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
      "$root/scripts/postgres.sh" start "$dir/pg" "$pg_port" >"$dir/pg.lines"
      pg_args=(--postgres "$(sed -n 's/^postgres //p' "$dir/pg.lines")")
    fi

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
      # The command line, NUL-separated, so `node-start` runs the same one again.
      printf '%s\0' nsenter --net="/run/netns/$ns" "$bin" node --listen "$ip_addr:$node_port" \
        --advertise "$url" --etcd "$etcd_urls" --name "node$i" \
        --data-dir "$dir/node$i" --images-dir "$images" --token-file "$token_file" \
        --snapshot-dir "$dir/snapshots" \
        "${node_extra[@]}" >"$dir/node$i.cmd"
      start_node "$dir" "$i"
    done
    for ((i = 0; i < n; i++)); do
      url="http://$subnet.$((10 + i)):$node_port"
      wait_http "$url/v1/info" "$token" "$(cat "$dir/node$i.pid")" ||
        { tail -n 20 "$dir/node$i.log" >&2; die "node$i did not answer at $url"; }
    done

    for ((i = 0; i < servers; i++)); do
      stem=$(server_stem "$dir" "$i")
      port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
      # The command line, NUL-separated, so `server-start` runs the same one again.
      printf '%s\0' "$bin" server --listen "127.0.0.1:$port" --etcd "$etcd_urls" --name "srv$i" \
        --node-token-file "$token_file" --data-dir "$stem" --images-dir "$images" \
        "${pg_args[@]}" "${server_extra[@]}" >"$stem.cmd"
      start_server "$stem"
      echo "http://127.0.0.1:$port" >"$stem.url"
    done
    for ((i = 0; i < servers; i++)); do
      stem=$(server_stem "$dir" "$i")
      wait_http "$(cat "$stem.url")/v1/ping" "" "$(cat "$stem.pid")" ||
        { tail -n 20 "$stem.log" >&2; die "server $i did not answer at $(cat "$stem.url")"; }
    done

    started=1
    cat "$dir/etcd.lines"
    [ "$postgres" = 0 ] || cat "$dir/pg.lines"
    for ((i = 0; i < servers; i++)); do echo "server $(cat "$(server_stem "$dir" "$i").url")"; done
    for ((i = 0; i < n; i++)); do echo "node node$i http://$subnet.$((10 + i)):$node_port"; done
    ;;
  down)
    [ -d "$dir" ] || exit 0
    dir=$(cd "$dir" && pwd)
    n=$(cat "$dir/nodes" 2>/dev/null || echo 0)
    servers=$(cat "$dir/servers" 2>/dev/null || echo 1)
    # Sandboxes first, through the first server still running, while the nodes still run:
    # their jails, mounts and cgroups go the normal way.
    for ((i = 0; i < servers; i++)); do
      stem=$(server_stem "$dir" "$i")
      [ -f "$stem.pid" ] && kill -0 "$(cat "$stem.pid")" 2>/dev/null || continue
      python3 - "$(cat "$stem.url")" <<'EOF' || echo "cluster.sh: deleting sandboxes failed; cleaning up below" >&2
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
      break
    done
    for ((i = 0; i < servers; i++)); do stop_pid "$(server_stem "$dir" "$i").pid"; done
    for ((i = 0; i < n; i++)); do stop_pid "$dir/node$i.pid"; done
    [ ! -d "$dir/etcd" ] || "$root/scripts/etcd.sh" stop "$dir/etcd"
    [ ! -d "$dir/pg/data" ] || "$root/scripts/postgres.sh" stop "$dir/pg" ||
      echo "cluster.sh: stopping PostgreSQL failed" >&2
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
  node-start)
    # Start node I again (after a kill or a crash) with the command line `up` gave it: same
    # namespace, data dir and name; wait until it answers.
    i=${3:-}
    dir=$(cd "$dir" && pwd)
    [ -f "$dir/node$i.cmd" ] || die "no node '$i' in $dir"
    ! { [ -f "$dir/node$i.pid" ] && kill -0 "$(cat "$dir/node$i.pid")" 2>/dev/null; } ||
      die "node$i is running (pid $(cat "$dir/node$i.pid"))"
    start_node "$dir" "$i"
    url="http://$subnet.$((10 + i)):$node_port"
    wait_http "$url/v1/info" "$(cat "$dir/node-token")" "$(cat "$dir/node$i.pid")" ||
      { tail -n 20 "$dir/node$i.log" >&2; die "node$i did not answer at $url"; }
    echo "node node$i $url"
    ;;
  server-start)
    # Start server I again (after a kill) with the command line `up` gave it: same port,
    # name, data dir and flags; wait until it answers.
    i=${3:-}
    dir=$(cd "$dir" && pwd)
    [[ "$i" =~ ^[0-9]$ ]] || die "server-start needs a server index, got '$i'"
    stem=$(server_stem "$dir" "$i")
    [ -f "$stem.cmd" ] || die "no server '$i' in $dir"
    ! { [ -f "$stem.pid" ] && kill -0 "$(cat "$stem.pid")" 2>/dev/null; } ||
      die "server $i is running (pid $(cat "$stem.pid"))"
    start_server "$stem"
    wait_http "$(cat "$stem.url")/v1/ping" "" "$(cat "$stem.pid")" ||
      { tail -n 20 "$stem.log" >&2; die "server $i did not answer at $(cat "$stem.url")"; }
    echo "server $(cat "$stem.url")"
    ;;
  *) usage ;;
esac
