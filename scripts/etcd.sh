#!/usr/bin/env bash
# Local etcd members on 127.0.0.1 for tests, demos and scripts/cluster.sh.
#
#   scripts/etcd.sh start DIR [N]      start N members (default 1; 3 for a cluster) with
#                                      free ports, data under DIR; wait until every member
#                                      answers /health; print one line per member:
#                                      `etcd http://127.0.0.1:PORT`
#   scripts/etcd.sh stop DIR           stop every member started under DIR (SIGTERM, then
#                                      SIGKILL after 10 s); the data stays under DIR
#   scripts/etcd.sh urls DIR           print the client URLs, comma-separated (for --etcd)
#   scripts/etcd.sh stop-member DIR I  stop member I (0-based) only: a crashed member
#   scripts/etcd.sh start-member DIR I start member I again on its ports and data; wait
#                                      until it is healthy
#   scripts/etcd.sh pause-member DIR I SIGSTOP member I (a hung or partitioned member:
#                                      connections stay open, nothing answers)
#   scripts/etcd.sh resume-member DIR I SIGCONT member I
#
# ETCD_HOST (default 127.0.0.1): the address the members' client and peer URLs use (e.g. a
# bridge address that nodes in their own network namespaces reach; scripts/cluster.sh).
#
# Layout under DIR: mI/ (data), mI.log, mI.pid, mI.args (the member's command line, so
# start-member restarts it on the same ports). Needs `etcd` (Debian etcd-server; setup.sh
# installs it), curl and python3 (to find free ports). Timings are etcd's defaults
# (heartbeat 100 ms, election timeout 1 s).
set -euo pipefail

die() { echo "etcd.sh: $*" >&2; exit 1; }

usage() { sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

# free_ports K: K distinct TCP ports the kernel considers free now (bound all at once, so
# they differ; a race with another process grabbing one before etcd does is possible but
# rare on a test host, and start then fails loudly).
free_ports() {
  python3 - "$1" "$host" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket()
    s.bind((sys.argv[2], 0))
    socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

alive() { # alive PIDFILE
  [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

client_url() { # client_url DIR I
  sed -n 's/^client=//p' "$1/m$2.args"
}

launch() { # launch DIR I: start member I from its saved command line
  local dir=$1 i=$2
  alive "$dir/m$i.pid" && return 0
  local -a args
  mapfile -t args < <(sed -n 's/^arg=//p' "$dir/m$i.args")
  # setsid + redirections: the member outlives this script and holds none of its caller's
  # pipes open (a test that reads this script's output gets EOF when it exits).
  setsid etcd "${args[@]}" </dev/null >>"$dir/m$i.log" 2>&1 &
  echo $! >"$dir/m$i.pid"
}

wait_healthy() { # wait_healthy DIR I...: poll /health of each member, 30 s deadline
  local dir=$1; shift
  local deadline=$((SECONDS + 30)) i url
  for i in "$@"; do
    url=$(client_url "$dir" "$i")
    until curl -fsS --max-time 1 "$url/health" 2>/dev/null | grep -q '"health":"true"'; do
      alive "$dir/m$i.pid" || die "member $i exited; see $dir/m$i.log: $(tail -n 3 "$dir/m$i.log")"
      [ $SECONDS -lt $deadline ] || die "member $i not healthy after 30 s; see $dir/m$i.log"
      sleep 0.1
    done
  done
}

members() { # members DIR: the indices of the members under DIR
  local f
  for f in "$1"/m*.args; do
    [ -e "$f" ] || continue
    f=${f##*/m}; echo "${f%.args}"
  done | sort -n
}

cmd=${1:-}; dir=${2:-}
host=${ETCD_HOST:-127.0.0.1}
[ -n "$cmd" ] && [ -n "$dir" ] || usage

case "$cmd" in
  start)
    n=${3:-1}
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || die "N must be a positive integer, got '$n'"
    command -v etcd >/dev/null || die "etcd not found (Debian: apt-get install etcd-server; scripts/setup.sh installs it)"
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ -z "$(members "$dir")" ] || die "$dir already holds members; stop them and use a fresh DIR"
    read -r -a ports <<<"$(free_ports $((2 * n)))"
    cluster=""
    for ((i = 0; i < n; i++)); do
      cluster+="${cluster:+,}m$i=http://$host:${ports[2 * i + 1]}"
    done
    token="sandlot-$(basename "$dir")-$$"
    for ((i = 0; i < n; i++)); do
      c="http://$host:${ports[2 * i]}"
      p="http://$host:${ports[2 * i + 1]}"
      {
        echo "client=$c"
        for a in --name "m$i" --data-dir "$dir/m$i" \
          --listen-client-urls "$c" --advertise-client-urls "$c" \
          --listen-peer-urls "$p" --initial-advertise-peer-urls "$p" \
          --initial-cluster "$cluster" --initial-cluster-token "$token" \
          --initial-cluster-state new --logger zap --log-outputs stderr; do
          echo "arg=$a"
        done
      } >"$dir/m$i.args"
      launch "$dir" "$i"
    done
    wait_healthy "$dir" $(members "$dir")
    for i in $(members "$dir"); do echo "etcd $(client_url "$dir" "$i")"; done
    ;;
  stop)
    [ -d "$dir" ] || exit 0
    pids=()
    for i in $(members "$dir"); do
      if alive "$dir/m$i.pid"; then
        pid=$(cat "$dir/m$i.pid")
        kill -CONT "$pid" 2>/dev/null || true # a paused member cannot act on SIGTERM
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid")
      fi
      rm -f "$dir/m$i.pid"
    done
    deadline=$((SECONDS + 10))
    for pid in "${pids[@]}"; do
      while kill -0 "$pid" 2>/dev/null; do
        if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; fi
        sleep 0.1
      done
    done
    ;;
  urls)
    urls=""
    for i in $(members "$dir"); do urls+="${urls:+,}$(client_url "$dir" "$i")"; done
    echo "$urls"
    ;;
  stop-member | start-member | pause-member | resume-member)
    i=${3:-}
    [ -f "$dir/m$i.args" ] || die "no member '$i' under $dir"
    case "$cmd" in
      stop-member)
        if alive "$dir/m$i.pid"; then
          pid=$(cat "$dir/m$i.pid")
          kill -CONT "$pid" 2>/dev/null || true
          kill -TERM "$pid"
          deadline=$((SECONDS + 10))
          while kill -0 "$pid" 2>/dev/null; do
            if [ $SECONDS -ge $deadline ]; then kill -KILL "$pid" 2>/dev/null || true; fi
            sleep 0.1
          done
        fi
        rm -f "$dir/m$i.pid"
        ;;
      start-member)
        launch "$dir" "$i"
        wait_healthy "$dir" "$i"
        echo "etcd $(client_url "$dir" "$i")"
        ;;
      pause-member) alive "$dir/m$i.pid" || die "member $i is not running"; kill -STOP "$(cat "$dir/m$i.pid")" ;;
      resume-member) alive "$dir/m$i.pid" || die "member $i is not running"; kill -CONT "$(cat "$dir/m$i.pid")" ;;
    esac
    ;;
  *) usage ;;
esac
