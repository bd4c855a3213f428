#!/usr/bin/env bash
# README command 2: set everything up, then run every test: Rust unit and integration tests
# (the jail tests need root) and the end-to-end pytest suite against a live `sandlot up`.
# Skipped tests print why; the summary lines show the skip counts.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

: "${SANDLOT_IMAGES_DIR:=/var/lib/sandlot/images}"
export SANDLOT_IMAGES_DIR
export SANDLOT_BIN="$PWD/target/release/sandlot"
# The static build of sandlot-guest (setup.sh makes it), as `sandlot up` picks by default.
export SANDLOT_GUEST_BIN="$PWD/target/x86_64-unknown-linux-gnu/release/sandlot-guest"

printf '\n(setup took %s s)\n' "$SECONDS"
printf '\n==> cargo fmt --check, clippy -D warnings, rustdoc -D warnings\n'
if cargo fmt --version >/dev/null 2>&1; then cargo fmt --all -- --check
else echo "SKIPPED: cargo fmt --check (rustfmt is not installed: rustup component add rustfmt)"; fi
if cargo clippy --version >/dev/null 2>&1; then
  cargo clippy --release --locked --workspace --all-targets -- -D warnings
else echo "SKIPPED: cargo clippy (not installed: rustup component add clippy)"; fi
RUSTDOCFLAGS="-D warnings" cargo doc --release --locked --no-deps --workspace
# The node crate's module graph has no import cycles (issue 24; prints the summary line).
python3 scripts/modgraph.py crates/sandlot-node/src

printf '\n==> cargo test at +%s s (release profile: shares the build with setup)\n' "$SECONDS"
cargo test --release --locked --workspace -- --test-threads=2

# cargo-fuzz targets (guest-agent frame decoder, image layer unpacker), FUZZ_SECONDS each
# (default 60); a crash fails the run, the summary prints the run counts.
printf '\n==> cargo fuzz (fuzz/; %s s per target)\n' "${FUZZ_SECONDS:-60}"
./scripts/fuzz.sh

# The conformance suite (tests/conformance) runs every case against every backend case:
# a case the server cannot run is skipped with the reason, unless SANDLOT_REQUIRE_BACKENDS
# (comma list: function, container-runc, container-runsc, microvm, vm; `container` = both
# container cases) names it, then it fails. Default: every backend setup.sh installs (function,
# runc and gVisor containers, microvm and vm: reduced sets of tests, TCG boots are slow).
: "${SANDLOT_REQUIRE_BACKENDS:=function,container-runc,container-runsc,microvm,vm}"
export SANDLOT_REQUIRE_BACKENDS

printf '\n==> at +%s s: pytest tests/ (end to end, through the Python SDK; required backends: %s) and the bench harness tests\n' \
  "$SECONDS" "$SANDLOT_REQUIRE_BACKENDS"
# Failures and errors are summarised last (-rsfE), on lines wide enough for their messages
# (COLUMNS): the end of a long log is the part most often read.
COLUMNS=400 .venv/bin/python -m pytest -q -rsfE --durations=40 tests/ bench/test_run.py

# The conformance suite again, against a local cluster (scripts/cluster.sh up DIR 1 --postgres
# --servers 2): creates and deletes through one server, everything else through the other;
# function and container-runc, a subset of each category (tests/conformance/conftest.py
# CLUSTER_CASES, CLUSTER_SUBSET).
printf '\n==> at +%s s: the conformance suite against a cluster (scripts/conformance-cluster.sh)\n' "$SECONDS"
./scripts/conformance-cluster.sh
printf '\n==> all tests passed; %s s in all\n' "$SECONDS"
