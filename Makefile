# Two commands do everything: `make demo` and `make test`. Each installs what is missing,
# configures, builds and runs.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: demo test test-cpp test-python parity-long python deps configure build bench clean
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
