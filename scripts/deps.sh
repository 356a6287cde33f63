#!/usr/bin/env bash
# Installs what the test suite and the benchmarks need beyond a Rust
# toolchain, from the distribution's packages, if missing:
#   redis-server  the peer of `dmrpc bench memserver`
#   etcd-server   etcd, for the etcd registry's tests and the cluster
#   iproute2      `ip netns`, for the memory-server test across namespaces
#   fonts-dejavu-core  the font of the benchmarks' PNG plots
#   libclang      bindgen, for iceoryx2 (the peer of `dmrpc bench rtt`)
# Needs root (or sudo) and the package registries; idempotent.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || need+=(fonts-dejavu-core)
ls /usr/lib/llvm-*/lib/libclang.so* /usr/lib/x86_64-linux-gnu/libclang*.so* >/dev/null 2>&1 \
  || need+=(libclang-dev)
[ ${#need[@]} -eq 0 ] && exit 0
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
echo "installing: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || { $sudo apt-get update >/dev/null && $sudo apt-get install -y --no-install-recommends "${need[@]}" >/dev/null; }
