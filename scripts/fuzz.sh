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
for t in ref_decode pool_open ns_table frame_decode ring_consume parts_join memserver_request memserver_serve image_request social_post grpc_wire heap_arg; do
  echo "== fuzz $t for ${secs}s"
  if [ "${KEEP:-0}" = 1 ]; then
    dirs=("fuzz/corpus/$t")
  else
    mkdir -p "$scratch/$t"
    dirs=("$scratch/$t" "fuzz/corpus/$t")
  fi
  # heap_arg keeps a pool mapped for the process's life: creating it maps
  # and unmaps the file once, and the bus-error message of that mapping
  # is leaked on purpose (a signal handler may still read it), which the
  # leak check at exit would report.
  # pool_open maps pools too (it leaks the same message), and its inputs
  # are whole pool files: the smallest pool is over 8 KiB, so a shorter
  # limit would cut every input down to its header.
  leaks=1
  max_len=8192
  [ "$t" = heap_arg ] && leaks=0
  [ "$t" = pool_open ] && leaks=0 && max_len=600000
  ASAN_OPTIONS="detect_leaks=$leaks" \
  cargo +nightly fuzz run "$t" "${dirs[@]}" -- -max_total_time="$secs" -max_len="$max_len" -detect_leaks="$leaks" 2>&1 \
    | grep -E "^#[0-9]+.*(DONE|pulse)|Done|ERROR|panicked" | tail -3
done
