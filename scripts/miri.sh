#!/usr/bin/env bash
# Runs, under Miri, the unit tests of the code that touches shared or peer
# memory through unsafe code or decodes peer bytes: the ring's raw
# accessors with a producer and a consumer on two threads, the decoders of
# frames (and their metadata), Refs, pool headers, page descriptors, the
# segment table of namespaces and
# memory-server requests, the waiting policy, deadline propagation and an
# answer's metadata slot, a client's receiving half (taken in turn by two
# threads), the async client's `Then` (its pinning is unsafe code), and
# dm-grpc's writer into pool pages and its reader of a body's frames,
# and dm-heap's checked views of documents read against rkyv's own reads.
# Undefined behaviour, an
# access out of bounds, a misaligned atomic or a data race fails them.
# (Tests that map pool files cannot run there: Miri maps only anonymous
# memory.) Needs the nightly toolchain; adds its miri component if missing.
# PROPTEST_CASES (default 8) sets the property tests' cases.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! cargo +nightly miri --version >/dev/null 2>&1; then
  rustup component add --toolchain nightly miri rust-src
fi
# Isolation off: proptest looks up the working directory.
export MIRIFLAGS="${MIRIFLAGS:--Zmiri-disable-isolation}"
export PROPTEST_CASES="${PROPTEST_CASES:-8}"
cargo +nightly miri test -p dm-rpc --lib -- transport::ring frame:: metadata:: wait:: deadline:: handoff:: async_client::tests::then_
cargo +nightly miri test -p dm-pool --lib -- layout:: refs:: desc:: pages:: namespace::table::
cargo +nightly miri test -p dm-memserver --lib -- proto:: cache::
cargo +nightly miri test -p dm-grpc --lib -- direct::by_ref::tests::runs_ direct::by_ref::tests::frames_
# Tree Borrows for dm-heap: rkyv 0.8's own check of an archived string
# retags a pointer in a way Stacked Borrows rejects and Tree Borrows
# accepts (the report points into rkyv, not into dm-heap).
MIRIFLAGS="$MIRIFLAGS -Zmiri-tree-borrows" \
  cargo +nightly miri test -p dm-heap --lib -- view::tests::a_view_reads alloc::
