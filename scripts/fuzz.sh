#!/usr/bin/env bash
# Fuzz every decoder of peer or disk bytes for SECONDS each (default 60),
# starting from and adding to the saved corpus in fuzz/corpus/. Installs
# cargo-fuzz (crates.io) if missing; needs the nightly toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
command -v cargo-fuzz >/dev/null 2>&1 || cargo install cargo-fuzz --locked
for t in ref_decode pool_open frame_decode ring_consume memserver_request memserver_serve image_request social_post; do
  echo "== fuzz $t for ${secs}s"
  cargo +nightly fuzz run "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -max_len=8192 2>&1 \
    | grep -E "^#[0-9]+.*(DONE|pulse)|Done|ERROR|panicked" | tail -3
done
