#!/usr/bin/env bash
# Installs what the build needs from Debian's packages, only where it is missing.
# Safe to run again: it does nothing once everything is present.
set -euo pipefail

packages=(
  build-essential cmake pkg-config
  libopenblas-dev      # projections: cblas_sgemm
  libgtest-dev         # tests
  libbenchmark-dev     # bench/
  libcli11-dev         # the mha command line
  libpng-dev           # attention-weight pictures from `mha demo`
  nlohmann-json3-dev   # safetensors headers (JSON)
  clang libclang-rt-14-dev  # libFuzzer and sanitizer runtimes for `make fuzz`
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "Installing missing Debian packages: ${missing[*]}"
sudo_cmd=()
[ "$(id -u)" -ne 0 ] && sudo_cmd=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
