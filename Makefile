# Two commands do everything: `make demo` and `make test`. Each installs what is missing,
# configures, builds and runs.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: demo test test-cpp test-python test-sanitize test-aarch64 fuzz parity-long python deps configure build bench onednn-bench clean cuda-report
PARITY_COUNT ?= 2000

deps:
	@bash scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_TESTS=ON -DMHA_BUILD_TOOLS=ON -DMHA_BUILD_BENCH=ON > /dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	@$(BUILD)/tools/mha demo

test: test-cpp test-python

test-cpp: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The C++ suite again under AddressSanitizer + UndefinedBehaviorSanitizer, then ThreadSanitizer
# (3 pool threads). allocator_may_return_null: one test asks for 64 TiB on purpose, to see an
# mha::Error rather than an abort; the sanitizers' allocators abort on such requests by default.
# die_after_fork=0: one test starts the pool in a forked child, which TSan refuses by default.
SANITIZE_CMAKE = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_BENCH=OFF -DMHA_CUDA=OFF
test-sanitize: deps
	@cmake -S . -B build-asan $(SANITIZE_CMAKE) -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" > /dev/null
	@cmake --build build-asan -j $(JOBS)
	@cd build-asan && ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)
	@cmake -S . -B build-tsan $(SANITIZE_CMAKE) -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" > /dev/null
	@cmake --build build-tsan -j $(JOBS)
	@cd build-tsan && TSAN_OPTIONS=allocator_may_return_null=1:halt_on_error=1:die_after_fork=0 MHA_NUM_THREADS=3 ctest --output-on-failure -j $(JOBS)

# The library, its C++ suite and the command line built for 64-bit Arm Linux
# (cmake/aarch64-linux-gnu.cmake), where the portable kernels run (src/cpu/simd_portable.hpp),
# and the suite (the command line's tests too) run under qemu-aarch64. Not the benchmark: the
# executables are static, and Debian's Google Benchmark package exports only its shared library.
AARCH64_CMAKE = -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DCMAKE_BUILD_TYPE=Release \
  -DMHA_BUILD_TESTS=ON -DMHA_BUILD_TOOLS=ON -DMHA_BUILD_BENCH=OFF -DMHA_CUDA=OFF -DMHA_DNNL=OFF
test-aarch64:
	@bash scripts/install-deps.sh aarch64
	@cmake -S . -B build-aarch64 $(AARCH64_CMAKE) > /dev/null
	@cmake --build build-aarch64 -j $(JOBS)
	@cd build-aarch64 && ctest --output-on-failure -j $(JOBS)

# libFuzzer targets (clang), each run for FUZZ_SECONDS from its seed corpus in fuzz/corpus/
# (written by fuzz/make_seeds.py). New inputs go to build-fuzz/corpus/ (the committed seeds stay
# as they are); each run's log is build-fuzz/fuzz_<target>.log; a finding stops the run, prints
# the end of the log and leaves its input in build-fuzz/ (replay: build-fuzz/fuzz/fuzz_<target> <file>).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS = safetensors npy validation differential module_differential paged
fuzz:
	@bash scripts/install-deps.sh fuzz
	@cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_BUILD_TESTS=OFF \
	  -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_BENCH=OFF -DMHA_BUILD_FUZZ=ON -DMHA_CUDA=OFF \
	  -DCMAKE_CXX_FLAGS="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all" > /dev/null
	@cmake --build build-fuzz -j $(JOBS)
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p build-fuzz/corpus/$$t; \
	  ASAN_OPTIONS=allocator_may_return_null=1 UBSAN_OPTIONS=print_stacktrace=1 \
	    build-fuzz/fuzz/fuzz_$$t build-fuzz/corpus/$$t fuzz/corpus/$$t -max_total_time=$(FUZZ_SECONDS) \
	    -rss_limit_mb=4096 -artifact_prefix=build-fuzz/ -print_final_stats=1 > build-fuzz/fuzz_$$t.log 2>&1; \
	  rc=$$?; \
	  echo "fuzz_$$t: $(FUZZ_SECONDS) s, $$(sed -n 's/^stat::number_of_executed_units: *//p' build-fuzz/fuzz_$$t.log) executions"; \
	  if [ $$rc -ne 0 ]; then tail -n 60 build-fuzz/fuzz_$$t.log; echo "fuzz_$$t FAILED (exit $$rc)"; exit 1; fi; \
	done

# ptxas's registers, shared memory and spills for every CUDA kernel (needs nvcc, not a GPU).
cuda-report: deps
	@cmake -S . -B build-cuda-report -DCMAKE_BUILD_TYPE=Release -DMHA_CUDA=ON -DMHA_CUDA_RESOURCE_REPORT=ON \
	  -DMHA_BUILD_TESTS=OFF -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_BENCH=OFF > /dev/null
	@touch src/cuda/*.cu && cmake --build build-cuda-report --target mha_cuda -j $(JOBS) 2>&1 \
	  | grep -E "Compiling entry|registers|spill" | sed -E 's/_ZN3mha6detail[^ ]*flash_forward_kernelI//'

python: deps
	@bash scripts/python-env.sh

# The Python package against PyTorch: PARITY_COUNT random configurations per parity test.
test-python: python
	@$(BUILD)/venv/bin/python -m pytest -q -W ignore::UserWarning python/tests --parity-count $(PARITY_COUNT)

parity-long: python
	@$(BUILD)/venv/bin/python -m pytest -q -W ignore::UserWarning python/tests --parity-count 50000

# oneDNN's SDPA (its Graph API) as a third column of the comparison: the oneDNN 3.2 wheels from PyPI
# go into the virtual environment, and bench/onednn_sdpa.cpp is built against them.
ONEDNN_VERSION ?= 2023.2.0
onednn-bench: python
	@$(BUILD)/venv/bin/python -m pip show -q onednn-devel-cpu-gomp >/dev/null 2>&1 || \
	  $(BUILD)/venv/bin/pip install -q onednn-cpu-gomp==$(ONEDNN_VERSION) onednn-devel-cpu-gomp==$(ONEDNN_VERSION)
	@mkdir -p $(BUILD)/bench
	@$(CXX) -std=c++17 -O2 -I$(BUILD)/venv/include bench/onednn_sdpa.cpp -L$(BUILD)/venv/lib -ldnnl \
	  -Wl,-rpath,$(abspath $(BUILD))/venv/lib -o $(BUILD)/bench/onednn_sdpa

# The side-by-side comparison with PyTorch and oneDNN (table, plot in docs/) and the Google
# Benchmark suite.
bench: build python onednn-bench
	@$(BUILD)/venv/bin/python -c "import matplotlib" 2>/dev/null || $(BUILD)/venv/bin/pip install -q matplotlib
	@$(BUILD)/venv/bin/python bench/compare.py --lengths 128 512 2048 --dims 64 128 --plot docs/attention_gflops.png --peak-memory 32768
	@$(BUILD)/bench/mha_bench --benchmark_min_time=0.5

clean:
	@rm -rf $(BUILD)
