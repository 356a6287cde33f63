#!/usr/bin/env bash
# Fuzz every decoder of peer or disk bytes for SECONDS each (default 60),
# starting from the saved corpus in fuzz/corpus/. The saved corpus is only
# read: new inputs go to a scratch directory, removed at the end (libFuzzer
# writes to, and replaces inputs in, the first corpus directory it is
# given, so a run over fuzz/corpus/ itself swapped saved inputs for
# reductions). KEEP=1 adds the new inputs to the saved corpus instead.
# Installs cargo-fuzz (crates.io) if missing; needs the nightly toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for t in ref_decode pool_open frame_decode ring_consume parts_join memserver_request memserver_serve image_request social_post grpc_wire; do
  echo "== fuzz $t for ${secs}s"
  if [ "${KEEP:-0}" = 1 ]; then
    dirs=("fuzz/corpus/$t")
  else
    mkdir -p "$scratch/$t"
    dirs=("$scratch/$t" "fuzz/corpus/$t")
  fi
  cargo +nightly fuzz run "$t" "${dirs[@]}" -- -max_total_time="$secs" -max_len=8192 2>&1 \
    | grep -E "^#[0-9]+.*(DONE|pulse)|Done|ERROR|panicked" | tail -3
done
