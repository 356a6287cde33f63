#!/usr/bin/env bash
# Times two builds of examples/noop_loop against each other: PAIRS pairs of
# short runs, A then B, and the median of the per-pair ratios B/A (below 1:
# B is faster). Interleaving cancels most of a shared host's drift (on the
# 2-core VM the round trip moves by up to 2x between minutes); a change of
# a few percent shows in the median of 16-20 pairs, not in one run.
#
#   scripts/call-time.sh A_BINARY B_BINARY [PAIRS] [CALLS]
#
# (Copy target/release/examples/noop_loop aside before and after a change.)
# Its environment (SIZE, BYREF, ECHO, POLICY, ...: see noop_loop.rs) goes
# to both.
set -euo pipefail
a=$1
b=$2
pairs=${3:-16}
calls=${4:-300000}
ratios=()
for _ in $(seq "$pairs"); do
  ta=$("$a" "$calls" 2>&1 | grep -o '^[0-9]*' | head -1)
  tb=$("$b" "$calls" 2>&1 | grep -o '^[0-9]*' | head -1)
  printf '%s/%s ' "$ta" "$tb"
  ratios+=("$(python3 -c "print($tb / $ta)")")
done
echo
printf '%s\n' "${ratios[@]}" | python3 -c '
import statistics, sys
r = sorted(float(x) for x in sys.stdin)
faster = sum(x < 1 for x in r)
print(f"B/A ns per call: median {statistics.median(r):.3f}, range {r[0]:.3f}-{r[-1]:.3f}; B faster in {faster} of {len(r)} pairs")'
