#!/usr/bin/env bash
# The checks that need a GPU, in one run on the GPU machine (from the repository root):
#   1. configure with MHA_CUDA=ON and the ptxas resource report, build;
#   2. the C++ suite, whose Cuda.* and GpuTest.* tests compare the fused GPU kernels (forward and
#      backward) with the float64 reference on fresh random inputs (a seed is printed per test);
#   3. compute-sanitizer (memcheck, racecheck) on the GPU tests, where the toolkit has it, with the
#      device block cache off (MHA_CUDA_CACHE_MB=0) so that every free is seen;
#   4. the rest of the C++ suite.
# Without a GPU the GPU tests skip (and say so); the script then stops with status 2.
# A GPU machine without the project's dependencies (OpenBLAS, GoogleTest, ...) can run a test
# binary built elsewhere with MHA_CUDA=ON: MHA_GPU_TESTS=path/to/mha_tests skips the build in step 1;
# MHA_GPU_ONLY=1 skips step 4 (the CPU suite, which CI runs anyway).
set -euo pipefail
BUILD=${BUILD:-build-gpu}
JOBS=${JOBS:-$(nproc)}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || { echo "no GPU here"; exit 2; }
TESTS=${MHA_GPU_TESTS:-}
if [ -z "$TESTS" ]; then
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMHA_CUDA=ON -DMHA_CUDA_RESOURCE_REPORT=ON \
    -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_BENCH=OFF > /dev/null
  cmake --build "$BUILD" -j "$JOBS" 2>&1 | grep -E "ptxas info|spill|error" || true
  TESTS="$BUILD"/tests/mha_tests
fi
"$TESTS" --gtest_filter='Cuda.*:GpuTest.*'
if command -v compute-sanitizer > /dev/null; then
  for tool in memcheck racecheck; do
    MHA_CUDA_CACHE_MB=0 compute-sanitizer --tool "$tool" --error-exitcode 1 "$TESTS" \
      --gtest_filter='GpuTest.StridedViewsOfBatchFirstStorage:GpuTest.FullyMaskedRows*:GpuTest.HugeFinite*:GpuTest.BackwardGivesZeros*:GpuTest.BackwardRefuses*'
  done
else
  echo "compute-sanitizer not found: skipped"
fi
[ "${MHA_GPU_ONLY:-0}" = 1 ] || "$TESTS" --gtest_filter='-Cuda.*:GpuTest.*' --gtest_brief=1
