# Two commands do everything: `make demo` and `make test`. Each installs what is missing,
# configures, builds and runs.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: demo test test-cpp test-python test-sanitize parity-long python deps configure build bench clean
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
SANITIZE_CMAKE = -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMHA_BUILD_TOOLS=OFF -DMHA_BUILD_BENCH=OFF
test-sanitize: deps
	@cmake -S . -B build-asan $(SANITIZE_CMAKE) -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer" > /dev/null
	@cmake --build build-asan -j $(JOBS)
	@cd build-asan && ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j $(JOBS)
	@cmake -S . -B build-tsan $(SANITIZE_CMAKE) -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" > /dev/null
	@cmake --build build-tsan -j $(JOBS)
	@cd build-tsan && TSAN_OPTIONS=allocator_may_return_null=1:halt_on_error=1 MHA_NUM_THREADS=3 ctest --output-on-failure -j $(JOBS)

python: deps
	@bash scripts/python-env.sh

# The Python package against PyTorch: PARITY_COUNT random configurations per parity test.
test-python: python
	@$(BUILD)/venv/bin/python -m pytest -q -W ignore::UserWarning python/tests --parity-count $(PARITY_COUNT)

parity-long: python
	@$(BUILD)/venv/bin/python -m pytest -q -W ignore::UserWarning python/tests --parity-count 50000

# The side-by-side comparison with PyTorch (table, plot in docs/) and the Google Benchmark suite.
bench: build python
	@$(BUILD)/venv/bin/python -c "import matplotlib" 2>/dev/null || $(BUILD)/venv/bin/pip install -q matplotlib
	@$(BUILD)/venv/bin/python bench/compare.py --lengths 128 512 2048 --dims 64 128 --plot docs/attention_gflops.png --peak-memory 32768
	@$(BUILD)/bench/mha_bench --benchmark_min_time=0.5

clean:
	@rm -rf $(BUILD)
