#!/usr/bin/env bash
# Sets up everything Sandlot needs on a fresh Debian 12 machine, as root:
#   Debian packages, the OCI runtimes runc and runsc (scripts/install-runtimes.sh), the
#   release build (sandlot, sandlot-guest and its static build for containers), the Python
#   SDK with its test and example dependencies, the local images (busybox, python, and the
#   toolchain images lang-python, lang-go, lang-java, … that run_code's languages use), and
#   a local OCI registry on 127.0.0.1:5000 holding them as
#   127.0.0.1:5000/sandlot/{busybox,python}:latest (scripts/registry.sh; tests/test_images.py
#   pulls from it).
# Idempotent and cached: a second run skips what is already there (the python rootfs is
# cached under $SANDLOT_CACHE_DIR, default /var/cache/sandlot, and so is the runsc .deb).
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
# docker-registry, skopeo, umoci: the local OCI registry and the test images pushed into it.
# libssl-dev, pkg-config: TLS for registry pulls (oci-client through reqwest's native-tls).
# etcd-server: cluster membership, fencing and leader election (crates/sandlot-cluster;
# scripts/etcd.sh starts members for tests). protobuf-compiler: `protoc` for etcd-client's
# build (its gRPC stubs are generated at build time); libprotobuf-dev: the well-known types
# (google/protobuf/descriptor.proto, struct.proto) etcd's protos import — only a recommend of
# protobuf-compiler, so --no-install-recommends leaves it out and etcd-client's build fails.
# postgresql: cluster mode's durable state; the store tests start their own server in a temp
# dir through scripts/postgres.sh (Debian's postgresql-common also starts a system cluster on
# 5432, which Sandlot does not use).
pkgs=(busybox-static debootstrap bubblewrap iproute2 nftables procps curl ca-certificates chromium fonts-liberation
      docker-registry skopeo umoci libssl-dev pkg-config etcd-server protobuf-compiler libprotobuf-dev postgresql)
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

step "OCI runtimes for the container backend (runc from Debian 12, runsc from Debian 13's package)"
./scripts/install-runtimes.sh

step "QEMU and the microvm guest kit (scripts/guest-kit.sh)"
./scripts/guest-kit.sh

step "Rust build (release)"
cargo build --release --locked --workspace --bins
# The guest agent runs inside containers whose images may have no libc (busybox,
# distroless): a second, statically linked build of sandlot-guest, found by the node at
# target/x86_64-unknown-linux-gnu/release/sandlot-guest (an explicit --target keeps the
# flag away from build scripts and proc macros).
CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
  cargo build --release --locked -p sandlot-guest --target x86_64-unknown-linux-gnu

step "Fuzzing toolchain (nightly Rust, cargo-fuzz) for scripts/fuzz.sh"
./scripts/install-fuzz.sh

step "Python SDK and test/example dependencies (virtual environment .venv)"
# A project-local venv: no change to the machine's Python, and no PEP 668 refusal on a
# Debian-managed python3. Debian's python3 needs python3-venv for this.
if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e "sdk/python[test]"
# verl's SandboxFusion reward client (tests/test_verl_client.py loads its two files on their
# own): --no-deps, since verl itself pulls torch, ray, vllm, ...; the client needs requests.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1
.venv/bin/python -m pip install -q --disable-pip-version-check requests
# E2B's own Python SDK drives tests/test_e2b_sdk.py against Sandlot's E2B API (docs/e2b.md);
# checked with e2b 2.63.0.
.venv/bin/python -m pip install -q --disable-pip-version-check "e2b>=2.0,<3"
# E2B's code-interpreter SDK drives tests/test_e2b_code_interpreter.py (checked with 2.11.5).
.venv/bin/python -m pip install -q --disable-pip-version-check "e2b-code-interpreter>=2.0,<3"
# deploy/kubernetes/*.yaml are checked against Kubernetes' OpenAPI schemas by
# tests/test_deploy.py (checked with kubernetes-validate 1.37.0).
.venv/bin/python -m pip install -q --disable-pip-version-check "kubernetes-validate==1.37.0"

step "E2B's JavaScript SDK for tests/test_e2b_js.py (npm ci in tests/e2b_js)"
# The exact `e2b` version is pinned in tests/e2b_js/package-lock.json (node_modules is
# git-ignored). node and npm from Debian when missing (Debian 12's nodejs is 18; the SDK
# asks for node >= 20.18.1, which these machines have: checked with node 20.20 and npm 11).
if ! command -v npm >/dev/null 2>&1; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm
fi
(cd tests/e2b_js && npm ci --prefer-offline --no-audit --no-fund --loglevel=error)

step "Images (busybox, python) in $SANDLOT_IMAGES_DIR"
mkdir -p "$SANDLOT_IMAGES_DIR" "$SANDLOT_CACHE_DIR"
./target/release/sandlot image build busybox --images-dir "$SANDLOT_IMAGES_DIR"
./target/release/sandlot image build python --images-dir "$SANDLOT_IMAGES_DIR" --cache-dir "$SANDLOT_CACHE_DIR"
# Toolchain images: one layer per toolchain over python's (apt/pip/npm in a chroot; a layer
# whose recipe is unchanged is reused, so a second run takes seconds). The first build
# downloads ~1.5 GB; set SANDLOT_TOOLCHAINS to a space-separated subset (e.g. "lang-go")
# or to "none" to skip.
toolchains="${SANDLOT_TOOLCHAINS:-lang-all}"
if [ "$toolchains" != none ]; then
  step "Toolchain images ($toolchains) in $SANDLOT_IMAGES_DIR"
  # shellcheck disable=SC2086
  ./target/release/sandlot image build $toolchains --images-dir "$SANDLOT_IMAGES_DIR" \
    --cache-dir "$SANDLOT_CACHE_DIR"
fi
./target/release/sandlot image ls --images-dir "$SANDLOT_IMAGES_DIR"

step "Local OCI registry on ${SANDLOT_REGISTRY_ADDR:-127.0.0.1:5000} with the test images"
./scripts/registry.sh start
./scripts/registry.sh push
