#!/usr/bin/env bash
# Installs what the build needs from Debian's packages, only where it is missing.
# Safe to run again: it does nothing once everything is present.
# `install-deps.sh fuzz` adds clang and its runtimes (libFuzzer, sanitizers), which only
# `make fuzz` needs; `make demo` and `make test` build with GCC.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libopenblas-dev      # projections: cblas_sgemm
  libdnnl-dev          # bf16 projections on CPUs with AVX512-BF16 or AMX (oneDNN matmul)
  libgtest-dev         # tests
  libbenchmark-dev     # bench/
  libcli11-dev         # the mha command line
  libpng-dev           # attention-weight pictures from `mha demo`
  nlohmann-json3-dev   # safetensors headers (JSON)
)
if [ "${1:-}" = fuzz ]; then
  packages+=(clang libclang-rt-14-dev)  # clang 14; libclang_rt.fuzzer and the sanitizer runtimes
fi
# `install-deps.sh aarch64`: the cross build for 64-bit Arm and qemu to run its tests
# (make test-aarch64), with the arm64 libraries from Debian's multiarch packages.
if [ "${1:-}" = aarch64 ]; then
  packages+=(g++-aarch64-linux-gnu qemu-user libopenblas-dev:arm64 libgtest-dev:arm64 libpng-dev:arm64)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "Installing missing Debian packages: ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
if [ "${1:-}" = aarch64 ] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  "${sudo_cmd[@]}" dpkg --add-architecture arm64
fi
# A package run cut short earlier (a killed job, a rebooted machine) leaves dpkg half-configured,
# and apt-get then refuses everything; finishing it first is what apt itself asks for.
"${sudo_cmd[@]}" dpkg --configure -a
"${sudo_cmd[@]}" apt-get update -qq
if ! "${sudo_cmd[@]}" apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "${missing[@]}"; then
  echo "apt-get install failed; repairing dpkg's state and trying once more"
  "${sudo_cmd[@]}" dpkg --configure -a
  "${sudo_cmd[@]}" apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends --fix-broken
  "${sudo_cmd[@]}" apt-get install -y -qq -o DPkg::Lock::Timeout=600 --no-install-recommends "${missing[@]}"
fi
