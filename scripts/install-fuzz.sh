#!/usr/bin/env bash
# Installs what scripts/fuzz.sh needs: the Rust nightly toolchain (libFuzzer's sanitizer
# flags are nightly-only) and cargo-fuzz (from crates.io, pinned, into ~/.cargo/bin).
# Idempotent: skips what is there.
set -euo pipefail
CARGO_FUZZ_VERSION=0.13.2
if ! rustup toolchain list | grep -q '^nightly'; then
  rustup toolchain install nightly --profile minimal
else
  echo "nightly toolchain present"
fi
if cargo fuzz --version 2>/dev/null | grep -q "$CARGO_FUZZ_VERSION"; then
  echo "cargo-fuzz $CARGO_FUZZ_VERSION present"
else
  cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
fi
