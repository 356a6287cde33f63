#!/usr/bin/env bash
# The whole test suite: formatting, lints, the API docs, the demo and a benchmark smoke run,
# the loom models, the unsafe and decoding code's unit tests under Miri,
# then every unit, property, multi-process and fuzz-corpus test. Needs a
# Rust toolchain (stable; the loom step uses stable too, Miri the nightly
# one, whose miri component it adds); scripts/deps.sh installs the rest (redis-server for the memory-server
# bench's peer) from the distribution's packages, scripts/python.sh the
# Python package and its PyPI dependencies (Ray for `bench ray`).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

step() { printf '\n== %s\n' "$*"; }

step "dependencies (scripts/deps.sh)"
./scripts/deps.sh

step "rustfmt"
cargo fmt --all -- --check
cargo fmt --manifest-path crates/dmrpc-py/Cargo.toml -- --check

step "clippy -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings
CARGO_TARGET_DIR=target/py cargo clippy --manifest-path crates/dmrpc-py/Cargo.toml --release -- -D warnings
# The library without memory servers: dm-rpc reaches them only through its
# `memserver` feature.
cargo clippy -p dm-rpc -p dmrpc --no-default-features --all-targets -- -D warnings

step "API docs, every link resolved (cargo doc -D warnings)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace

step "build (release), and the Python package with its PyPI dependencies (scripts/python.sh setup)"
cargo build --release -p dmrpc-cli --features iceoryx2
./scripts/python.sh setup

step "demo (smoke run on its own pool)"
pool="ci-demo-$$"
trap 'rm -f "/dev/shm/dmrpc-$pool.pool"' EXIT
./target/release/dmrpc demo --pool "$pool" --sizes 64KiB,1MiB --calls 20
./target/release/dmrpc pool check "$pool" --deep
./target/release/dmrpc pool destroy "$pool"

step "the first example (examples/hello: a service and its client in two processes)"
cargo run --release -q -p dm-rpc --example hello

step "bench all --quick (checks each runs and writes its results, not its speed)"
out=target/bench-smoke
rm -rf "$out"
./target/release/dmrpc bench all --quick --out "$out"
for b in cow rtt threshold chain lb memserver ray access image social stream grpc heap failover scale; do
  for ext in json csv png; do
    test -s "$out/$b.$ext" || { echo "bench $b wrote no $b.$ext"; exit 1; }
  done
done

step "loom models of the lock-free protocols"
RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
  cargo test -p dm-pool -p dm-rpc --release --test loom

step "Miri: the unit tests of the unsafe and decoding code (scripts/miri.sh)"
if cargo +nightly miri --version >/dev/null 2>&1 \
  || rustup component add --toolchain nightly miri rust-src >/dev/null 2>&1; then
  ./scripts/miri.sh 2>&1 | tee target/miri-output.log
else
  echo "SKIPPED: no nightly toolchain with Miri here, and rustup could not add it"
  : > target/miri-output.log
fi

step "unit, property, multi-process tests, and the fuzz targets over their saved corpus"
mkdir -p target
cargo test --workspace 2>&1 | tee target/test-output.log

step "the pool's whole suite again, every test pool a namespace of one device file"
DMRPC_TEST_NAMESPACES=1 cargo test -p dm-pool 2>&1 | tee -a target/test-output.log

step "Python bindings: build with maturin, pytest (scripts/python.sh)"
./scripts/python.sh 2>&1 | tee -a target/test-output.log

# One closing line with the totals of every test binary above.
awk '/^test result:/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     / passed in / && !/^test result/ { for (i = 1; i <= NF; i++) { if ($i ~ /^passed/) p += $(i-1); if ($i ~ /^failed/) f += $(i-1) } }
     END { printf "\ntests: %d passed, %d failed\n", p, f }' target/miri-output.log target/test-output.log
