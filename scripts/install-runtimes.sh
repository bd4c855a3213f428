#!/usr/bin/env bash
# Installs the OCI runtimes of the `container` backend and checks that each one runs a
# busybox bundle (ENVIRONMENT.md):
#   runc  Debian 12's `runc` package (the default runtime on this cgroup v1 hybrid host).
#   runsc gVisor, which Debian 12 does not ship: the Debian 13 (trixie) package `runsc` is a
#         single static binary. It is fetched with apt-get through a private trixie source
#         list, private package lists and a private cache under $SANDLOT_CACHE_DIR, so the
#         machine's apt sources stay as they are and nothing else is upgraded; the binary is
#         taken out of the .deb (`dpkg -x`) and installed as $SANDLOT_RUNSC (default
#         /usr/local/bin/runsc). dpkg does not record it as installed.
# crun is not installed: it refuses cgroup v1 hybrid hosts like these ("cgroups in hybrid
# mode not supported"); install it from Debian on cgroup v2 hosts.
#
# Idempotent: an installed runsc whose version answers is kept (the .deb stays cached in
# $SANDLOT_CACHE_DIR/runsc); the smoke runs run every time (about 0.2 s together).
# Run as root; called by setup.sh, runs on its own too.
#
# Environment: SANDLOT_CACHE_DIR (default /var/cache/sandlot), SANDLOT_RUNSC (install path),
# SANDLOT_DEBIAN_MIRROR (default http://deb.debian.org/debian), SANDLOT_RUNSC_SUITE
# (default trixie).
set -euo pipefail

: "${SANDLOT_CACHE_DIR:=/var/cache/sandlot}"
: "${SANDLOT_RUNSC:=/usr/local/bin/runsc}"
: "${SANDLOT_DEBIAN_MIRROR:=http://deb.debian.org/debian}"
: "${SANDLOT_RUNSC_SUITE:=trixie}"

die() {
  printf 'install-runtimes.sh: %s\n' "$*" >&2
  exit 1
}

ms_since() { echo $(( ($(date +%s%N) - $1) / 1000000 )); }

[ "$(id -u)" = 0 ] || die "run as root (apt-get, /usr/local/bin, OCI runtimes need root)"

apt_install() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  apt-get -o DPkg::Lock::Timeout=600 update -qq \
    || die "apt-get update failed; cannot install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq \
    --no-install-recommends "${missing[@]}" \
    || die "apt-get install ${missing[*]} failed"
}

# busybox-static: the root file system of the smoke bundles. python3: edits runc's config.
apt_install runc busybox-static python3

# --- runsc from the trixie package -------------------------------------------------------
runsc_dir="$SANDLOT_CACHE_DIR/runsc"

fetch_runsc_deb() {
  # A private apt universe: only the trixie list below, its own lists, cache and lock.
  # The system's sources (Dir::Etc::SourceParts=/dev/null hides sources.list.d) and its
  # package state are not read for sources and not written.
  local apt="$runsc_dir/apt"
  mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  [ -r "$keyring" ] || die "$keyring missing (package debian-archive-keyring)"
  printf 'deb [signed-by=%s] %s %s main\n' "$keyring" "$SANDLOT_DEBIAN_MIRROR" \
    "$SANDLOT_RUNSC_SUITE" > "$apt/sources.list"
  local opts=(
    -o "Dir::Etc::SourceList=$apt/sources.list"
    -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$apt/lists"
    -o "Dir::Cache=$apt/cache"
    -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
    -o "Acquire::Languages=none"
    -o "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false"
    -o "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false"
    -o "APT::Sandbox::User=root"
  )
  apt-get "${opts[@]}" update -qq \
    || die "apt-get update of $SANDLOT_DEBIAN_MIRROR $SANDLOT_RUNSC_SUITE failed (mirror unreachable, or $keyring lacks the $SANDLOT_RUNSC_SUITE key: debian-archive-keyring 2023.3+deb12u1 and later carry Debian 13's)"
  # apt-get update only warns when a source is unreachable; the index must be there.
  ls "$apt/lists/"*_"$SANDLOT_RUNSC_SUITE"_main_binary-*_Packages* >/dev/null 2>&1 \
    || die "no $SANDLOT_RUNSC_SUITE package index from $SANDLOT_DEBIAN_MIRROR (mirror unreachable?)"
  rm -f "$runsc_dir"/runsc_*.deb
  (cd "$runsc_dir" && apt-get "${opts[@]}" download -qq runsc) \
    || die "apt-get download runsc from $SANDLOT_RUNSC_SUITE failed"
}

install_runsc() {
  mkdir -p "$runsc_dir"
  local deb
  deb=$(ls "$runsc_dir"/runsc_*.deb 2>/dev/null | head -n1 || true)
  if [ -z "$deb" ]; then
    local t0; t0=$(date +%s%N)
    fetch_runsc_deb
    deb=$(ls "$runsc_dir"/runsc_*.deb 2>/dev/null | head -n1 || true)
    [ -n "$deb" ] || die "apt-get download runsc left no .deb in $runsc_dir"
    echo "fetched $(basename "$deb") ($(du -k "$deb" | cut -f1) KiB) in $(ms_since "$t0") ms"
  else
    echo "cached: $deb"
  fi
  [ "$(dpkg-deb -f "$deb" Package)" = runsc ] || die "$deb is not the runsc package"
  local x; x=$(mktemp -d)
  dpkg -x "$deb" "$x" || { rm -rf "$x"; die "dpkg -x $deb failed"; }
  local bin="$x/usr/bin/runsc"
  [ -f "$bin" ] || { rm -rf "$x"; die "$deb has no usr/bin/runsc (layout changed?): $(dpkg-deb -c "$deb" | awk '{print $6}' | tr '\n' ' ')"; }
  # The package declares no Depends: the binary must be static to run on Debian 12.
  if ldd "$bin" >/dev/null 2>&1; then
    rm -rf "$x"
    die "runsc in $deb is dynamically linked; it may not run on this release"
  fi
  install -D -m 0755 "$bin" "$SANDLOT_RUNSC.new"
  mv -f "$SANDLOT_RUNSC.new" "$SANDLOT_RUNSC"
  rm -rf "$x"
  echo "installed $SANDLOT_RUNSC from $(basename "$deb")"
}

if [ -x "$SANDLOT_RUNSC" ] && "$SANDLOT_RUNSC" --version >/dev/null 2>&1; then
  echo "present: $SANDLOT_RUNSC"
else
  install_runsc
fi
"$SANDLOT_RUNSC" --version >/dev/null 2>&1 || die "$SANDLOT_RUNSC --version fails after install"

# --- smoke runs: a busybox bundle under each runtime --------------------------------------
work=$(mktemp -d /tmp/sandlot-runtime-smoke.XXXXXX)
trap 'rm -rf "$work"' EXIT

make_bundle() {  # $1 = bundle dir; rootfs = static busybox; config from the runtime's `spec`
  mkdir -p "$1/rootfs/bin"
  cp /bin/busybox "$1/rootfs/bin/busybox"
  ln -sf busybox "$1/rootfs/bin/sh"
}

smoke() {  # $1 = name, $2 = runtime binary, rest = global flags
  local name=$1 rt=$2; shift 2
  local b="$work/$name"
  make_bundle "$b"
  (cd "$b" && "$rt" spec) || die "$rt spec failed"
  # Non-interactive, read-only root, argv = busybox echo.
  python3 - "$b/config.json" <<'EOF' || die "could not edit $b/config.json"
import json, sys
p = sys.argv[1]
c = json.load(open(p))
c["process"]["terminal"] = False
c["process"]["args"] = ["/bin/busybox", "echo", "sandlot-smoke-ok"]
c["root"] = {"path": "rootfs", "readonly": True}
json.dump(c, open(p, "w"))
EOF
  local t0 out
  t0=$(date +%s%N)
  out=$(cd "$b" && timeout 60 "$rt" --root "$work/state-$name" "$@" run "sandlot-smoke-$$-$name" 2>&1) \
    || die "$name smoke run failed: $rt $* run → $out"
  local ms; ms=$(ms_since "$t0")
  [ "$out" = "sandlot-smoke-ok" ] || die "$name smoke run printed '$out', expected 'sandlot-smoke-ok'"
  echo "$name: $("$rt" --version | head -n1) — busybox bundle ran in ${ms} ms"
}

echo
echo "OCI runtimes installed:"
smoke runc "$(command -v runc || die 'runc not on PATH after install')"
smoke runsc "$SANDLOT_RUNSC" --platform=systrap --network=none --ignore-cgroups
printf '  runc  %s (Debian package %s)\n' "$(command -v runc)" "$(dpkg-query -W -f='${Version}' runc)"
printf '  runsc %s (%s, sha256 %s)\n' "$SANDLOT_RUNSC" \
  "$("$SANDLOT_RUNSC" --version | head -n1)" "$(sha256sum "$SANDLOT_RUNSC" | cut -c1-16)"
