#!/usr/bin/env bash
# What each layer of a no-op call costs, measured side by side: per round,
# the raw one-word ping-pong (the floor of `bench rtt`) and the ring alone
# (examples/ring_pingpong), then examples/noop_loop four ways — client and
# server (a real call), raw frames against the server (RAW=1: no client),
# the client against a bare listener (RAW_SERVER=1: no dispatcher), and
# raw frames against the bare listener (only the transport and framing).
# Rounds interleave the six so that the host's drift (up to 2x between
# minutes on the 2-core VM) falls on all of them alike; the medians over
# rounds are printed last, with each as a multiple of the floor.
#
#   scripts/call-layers.sh [ROUNDS] [CALLS]
#
# ROUNDS defaults to 6, CALLS (per noop_loop run) to 300000. Its
# environment (POLICY, SERVE_CPU, ...: see noop_loop.rs) goes to every
# noop_loop run.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-6}
calls=${2:-300000}
cargo build --release -q -p dm-rpc --example noop_loop --example ring_pingpong
bin=target/release/examples
out=$(mktemp)
trap 'rm -f "$out"' EXIT
first() { grep -o '^[0-9]*' | head -1; }
for r in $(seq "$rounds"); do
  pp=$("$bin/ring_pingpong" "$((calls * 4))")
  floor=$(sed -E 's/^raw ping-pong ([0-9]+) ns.*/\1/' <<<"$pp")
  ring=$(sed -E 's/.* ring ([0-9]+) ns.*/\1/' <<<"$pp")
  call=$("$bin/noop_loop" "$calls" | first)
  raw_client=$(RAW=1 "$bin/noop_loop" "$calls" | first)
  raw_server=$(RAW_SERVER=1 "$bin/noop_loop" "$calls" | first)
  raw_both=$(RAW=1 RAW_SERVER=1 "$bin/noop_loop" "$calls" | first)
  echo "$floor $ring $call $raw_client $raw_server $raw_both" | tee -a "$out" |
    awk -v r="$r" '{printf "round %s: floor %s  ring %s  call %s  no client %s  no dispatcher %s  neither %s ns\n", r, $1, $2, $3, $4, $5, $6}'
done
python3 - "$out" <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
names = ["floor (raw ping-pong)", "ring alone", "call (client + server)",
         "raw frames + server (no client)", "client + bare listener (no dispatcher)",
         "raw frames + bare listener"]
med = [statistics.median(c) for c in zip(*rows)]
ratio = [statistics.median(r[k] / r[0] for r in rows) for k in range(len(names))]
print(f"medians over {len(rows)} rounds (and of each round's multiple of its floor):")
for n, m, q in zip(names, med, ratio):
    print(f"  {n:<40} {m:6.0f} ns  {q:5.2f}x")
PY
