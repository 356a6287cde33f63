#!/usr/bin/env bash
# The Python package (crates/dmrpc-py, PyO3 + maturin) in a virtualenv of
# the project's (target/pyenv, made and filled from PyPI on first use:
# maturin, numpy, pytest, and ray for `dmrpc bench ray`).
# Usage: scripts/python.sh setup          builds and installs the package and
#                                         the Rust peers of its tests
#        scripts/python.sh [pytest args]  setup, then its pytest suite
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
venv="$root/target/pyenv"

setup() {
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import maturin, numpy, pytest, ray" >/dev/null 2>&1; then
    "$venv/bin/pip" install -q "maturin>=1.5,<2" numpy pytest "ray==2.*"
  fi
  (cd crates/dmrpc-py && VIRTUAL_ENV="$venv" CARGO_TARGET_DIR="$root/target/py" \
    "$venv/bin/maturin" develop --release -q)
  # The Rust peers of the tests and examples: a service/client agent, a
  # memory server, the Rust half of examples/rust_interop.py.
  cargo build --release -q -p dm-rpc --bin dm-rpc-agent --example py_interop \
    -p dm-memserver --bin dm-memserver
}

if [ "${1:-}" = setup ]; then
  setup
  exit 0
fi
setup
DMRPC_AGENT="$root/target/release/dm-rpc-agent" DMRPC_MEMSERVER="$root/target/release/dm-memserver" \
  "$venv/bin/pytest" -q crates/dmrpc-py/tests "$@"
