#!/usr/bin/env bash
# Instructions per no-op call outside the waits, on the client and on the
# server (callgrind over examples/noop_loop, both processes). Deterministic
# for a given binary: judges a change to the call path without the host's
# timing noise (BENCHMARKS.md, `bench rtt`). Needs valgrind.
#
#   scripts/call-cost.sh [BINARY] [CALLS]
#
# BINARY defaults to target/release/examples/noop_loop (built if missing);
# CALLS to 100000. The client's count is its call loop less the wait for
# the answer (the decode of the answer counted back in); the server's, its
# dispatcher less the wait for requests (the decode counted back in).
# Then the locked instructions (lock-prefixed, xchg with memory, mfence)
# each process runs about once per call or more, by function: each costs
# about 10 ns here (a stall), far more than a plain instruction, so the
# two counts together judge a change to the call path. Needs objdump.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/examples/noop_loop}
calls=${2:-100000}
if [ ! -x "$bin" ]; then
  cargo build --release -p dm-rpc --example noop_loop
fi
command -v valgrind >/dev/null || { echo "call-cost: needs valgrind" >&2; exit 2; }
bin=$(realpath "$bin")
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
(cd "$dir" && valgrind --tool=callgrind --trace-children=yes --dump-instr=yes \
  --callgrind-out-file="$dir/cg.%p" "$bin" "$calls" >/dev/null 2>&1)
for f in "$dir"/cg.*; do
  # (Run where the profile is: from the source tree, callgrind_annotate
  # splits a function's cost among the files it inlines.)
  (cd "$dir" && callgrind_annotate --inclusive=yes --threshold=100 "$f" 2>/dev/null) \
    | grep -v '=>' | sed 's/,//g' >"$f.txt"
  python3 - "$f.txt" "$calls" <<'PY'
import re, sys
incl = {}
for line in open(sys.argv[1]):
    m = re.match(r'\s*(\d+) \([^)]*\)\s+\S+?\.(?:rs|c|S):(.*?)( \[/.*)?$', line)
    if m and m.group(3):  # a function's own line (not an inlined attribution)
        name = m.group(2).strip()
        incl[name] = max(incl.get(name, 0), int(m.group(1)))
calls = int(sys.argv[2])
g = lambda k: incl.get(k, 0)
decode = g('dm_rpc::frame::Frame::decode_record')
run = g('dm_rpc::server::dispatch::Dispatcher::run') or g('dm_rpc::server::dispatch::Dispatcher::serve_until_stopped')
if run:
    nxt = g('<dm_rpc::transport::shm::ShmListener as dm_rpc::transport::Listener>::next')
    own = run - nxt + g('dm_rpc::transport::shm::ShmListener::decode_for')
    print(f"server: {own / calls:.0f} instructions per call")
elif g('noop_loop::main'):
    recv = g('<dm_rpc::transport::shm::ShmRx as dm_rpc::transport::FrameRx>::recv')
    own = g('noop_loop::main') - recv + decode
    print(f"client: {own / calls:.0f} instructions per call")
PY
  objdump -d -C --no-show-raw-insn "$bin" >"$dir/dis.txt"
  python3 - "$f" "$dir/dis.txt" "$calls" "$(basename "$bin")" <<'PY'
import collections, re, sys
cg, dis, calls, obj = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
# Executions per instruction address of the binary itself (callgrind's
# compressed positions: absolute, or relative to the previous line; the
# line after `calls=` is a call's inclusive cost, not an execution).
runs, at, after_call, here, names = collections.Counter(), 0, False, False, {}
for line in open(cg):
    if line[:1].isdigit() or line[:1] in '+-*':
        parts = line.split()
        a = parts[0]
        if a.startswith('0x'):
            at = int(a, 16)
        elif a[0] in '+-':
            at += (1 if a[0] == '+' else -1) * int(a[1:], 0)
        if not after_call and here and len(parts) >= 3:
            runs[at] += int(parts[2])
        after_call = False
        continue
    after_call = line.startswith('calls=')
    m = re.match(r'(c?)ob=\((\d+)\)(?: (.*))?', line)
    if m:
        if m.group(3):
            names[m.group(2)] = m.group(3).strip()
        if not m.group(1):
            here = names.get(m.group(2), '').endswith('/' + obj)
locked, fn = collections.Counter(), None
for line in open(dis):
    m = re.match(r'^[0-9a-f]+ <(.*)>:', line)
    if m:
        fn = m.group(1)
        continue
    m = re.match(r'^\s+([0-9a-f]+):\s+(.*)$', line)
    if m and re.search(r'\block\b|xchg\s.*\(|mfence', m.group(2)):
        n = runs.get(int(m.group(1), 16), 0)
        if n >= calls // 2:
            locked[fn] += n
total = sum(locked.values())
print(f"  {total / calls:.1f} locked instructions per call:")
for f, n in locked.most_common():
    short = re.sub(r"::h[0-9a-f]{16}$", "", f)
    print(f"    {n / calls:.1f}  {short[:100]}")
PY
done
