#!/usr/bin/env bash
# Where a no-op call's round trip goes, by segment: the client's software
# before its request is published and after its answer is seen, the
# request's and the answer's way between the cores, and the server's
# software. examples/noop_loop built with dm-rpc's `probe` feature stamps
# the time-stamp counter at each point (src/probe.rs); the stamps of the
# two processes are joined in time, call by call. Each stamp costs about
# 25 ns (a fence, so that a load's miss is counted where it happens, then
# the counter read), so the segments add up to more than an unprobed call: compare
# segments with each other and between builds, not with `bench rtt`.
# The two ways are timed across cores: on a VM whose vCPUs' counters
# differ by an offset, one way gains what the other loses; their sum,
# and every segment within one process, stay exact.
#
#   scripts/call-split.sh [CALLS]
#
# CALLS defaults to 300000. Its environment (POLICY, SIZE, ...: see
# noop_loop.rs) goes to the loop. The build goes to target/probe.
set -euo pipefail
cd "$(dirname "$0")/.."
calls=${1:-300000}
CARGO_TARGET_DIR=target/probe cargo build --release -q -p dm-rpc \
  --example noop_loop --features dm-rpc/probe
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
PROBE="$dir/stamps" target/probe/release/examples/noop_loop "$calls"
python3 - "$dir/stamps" <<'PY'
import bisect, statistics, sys
def load(path):
    lines = open(path).read().split('\n')
    per_ns = float(lines[0])
    return per_ns, [sorted(int(x) for x in l.split()) for l in lines[1:7]]
per_ns, c = load(sys.argv[1] + '.client')
_, s = load(sys.argv[1] + '.server')
PUB, SEEN, START, END, H_IN, H_OUT = range(6)
def nxt(table, t):
    j = bisect.bisect_right(table, t)
    return table[j] if j < len(table) else None
rows = []
starts = c[START][len(c[START]) // 10:]  # after a warm-up
for k in range(len(starts) - 1):
    t = [starts[k]]
    for table in (c[PUB], s[SEEN], s[H_IN], s[H_OUT], s[PUB], c[SEEN], c[END]):
        x = nxt(table, t[-1])
        if x is None:
            break
        t.append(x)
    else:
        if starts[k + 1] > t[-1]:
            rows.append(t + [starts[k + 1]])
names = [
    "client: call start -> request published",
    "request: published -> seen by the server",
    "server: request seen -> handler starts",
    "server: the handler (a no-op)",
    "server: handler ends -> answer published",
    "answer: published -> seen by the client",
    "client: answer seen -> call returns",
    "client: call returns -> next call starts",
]
print(f"{len(rows)} calls, {per_ns:.3f} counter ticks per ns")
med = []
for i, name in enumerate(names):
    v = sorted((r[i + 1] - r[i]) / per_ns for r in rows)
    med.append(statistics.median(v))
    print(f"  {name:42s} {med[-1]:6.0f} ns  (p10 {v[len(v) // 10]:.0f}, p90 {v[9 * len(v) // 10]:.0f})")
rt = sorted((r[-1] - r[0]) / per_ns for r in rows)
client = med[0] + med[6] + med[7]
server = med[2] + med[3] + med[4]
ways = med[1] + med[5]
print(f"  round trip (median) {statistics.median(rt):.0f} ns; medians: client {client:.0f},"
      f" server {server:.0f}, the two ways {ways:.0f} ns")
PY
