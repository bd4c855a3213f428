#!/usr/bin/env bash
# Runs each cargo-fuzz target (fuzz/, libFuzzer on the nightly toolchain) for a bounded time
# and fails on the first crash, panic, failed assertion, leak or timeout:
#   frame_decoder  the guest-agent frame decoder (sandlot_guest::agent_proto::FrameDecoder)
#   layer_unpack   the OCI layer unpacker (crates/sandlot-layer), needs root
# Usage: scripts/fuzz.sh [SECONDS per target, default $FUZZ_SECONDS or 60] [TARGET...]
# Seeds: fuzz/seeds/<target> (committed); inputs found are kept in fuzz/corpus/<target>
# (ignored by git, reused by the next run on this machine). A crash leaves its input in
# fuzz/artifacts/<target>/; replay it with `cd fuzz && cargo +nightly fuzz run <target> FILE`.
# Needs: scripts/install-fuzz.sh (nightly toolchain, cargo-fuzz), run by setup.sh.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${1:-${FUZZ_SECONDS:-60}}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(frame_decoder layer_unpack)

# The targets' scratch files (layer_unpack's temp dirs) go to a directory removed at exit.
work=$(mktemp -d -t sandlot-fuzz.XXXXXX)
trap 'rm -rf "$work"' EXIT
export TMPDIR="$work"

# Release mode with debug assertions (cargo-fuzz's default -O adds -Cdebug-assertions) and
# AddressSanitizer (cargo-fuzz's default): unsafe syscall code is instrumented too.
cargo +nightly fuzz build -O
summary=()
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log=$(mktemp)
  printf '\n==> fuzz %s for %s s\n' "$t" "$secs"
  # -timeout: one input taking over 10 s is a hang; -rss_limit_mb: memory blow-ups fail.
  if ! cargo +nightly fuzz run -O "$t" "corpus/$t" "seeds/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      >"$log" 2>&1; then
    tail -n 60 "$log"
    echo "fuzz.sh: target $t FAILED; the input is in fuzz/artifacts/$t/" >&2
    exit 1
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  grep -E '^Done [0-9]+ runs' "$log" || true
  summary+=("$t: ${runs:-?} runs in ${secs} s, 0 crashes, corpus $(ls "corpus/$t" | wc -l) inputs")
  rm -f "$log"
done
printf '\n==> fuzz summary\n'
printf '%s\n' "${summary[@]}"
