#!/usr/bin/env bash
# Sets up everything Sandlot needs on a fresh Debian 12 machine, as root:
#   Debian packages, the release build (sandlot + sandlot-guest), the Python SDK with its
#   test and example dependencies, and the two local images (busybox, python).
# Idempotent and cached: a second run skips what is already there (the python rootfs is
# cached under $SANDLOT_CACHE_DIR, default /var/cache/sandlot).
set -euo pipefail
cd "$(dirname "$0")/.."

: "${SANDLOT_IMAGES_DIR:=/var/lib/sandlot/images}"
: "${SANDLOT_CACHE_DIR:=/var/cache/sandlot}"
export SANDLOT_IMAGES_DIR SANDLOT_CACHE_DIR

step() { printf '\n==> %s\n' "$*"; }

if [ "$(id -u)" != 0 ]; then
  echo "setup.sh: run as root (sandboxes need namespaces, mounts and cgroups)" >&2
  exit 1
fi

step "Debian packages"
# chromium + fonts-liberation: tests/test_web.py screenshots the status page headless
# (about 45 s to install here with recommends, less without; the test skips without it).
pkgs=(busybox-static debootstrap bubblewrap iproute2 nftables procps curl ca-certificates chromium fonts-liberation)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "all present: ${pkgs[*]}"
fi

step "Rust build (release)"
cargo build --release --locked --workspace --bins
# The guest agent runs inside containers whose images may have no libc (busybox,
# distroless): a second, statically linked build of sandlot-guest, found by the node at
# target/x86_64-unknown-linux-gnu/release/sandlot-guest (an explicit --target keeps the
# flag away from build scripts and proc macros).
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sandlot-guest --target x86_64-unknown-linux-gnu

step "Python SDK and test/example dependencies (virtual environment .venv)"
# A project-local venv: no change to the machine's Python, and no PEP 668 refusal on a
# Debian-managed python3. Debian's python3 needs python3-venv for this.
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e "sdk/python[test]"

step "Images (busybox, python) in $SANDLOT_IMAGES_DIR"
mkdir -p "$SANDLOT_IMAGES_DIR" "$SANDLOT_CACHE_DIR"
./target/release/sandlot image build busybox --images-dir "$SANDLOT_IMAGES_DIR"
./target/release/sandlot image build python --images-dir "$SANDLOT_IMAGES_DIR" --cache-dir "$SANDLOT_CACHE_DIR"
./target/release/sandlot image ls --images-dir "$SANDLOT_IMAGES_DIR"
