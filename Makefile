# Two commands do everything: `make demo` and `make test`. Each installs what is missing,
# configures, builds and runs.
BUILD ?= build
JOBS ?= $(shell nproc)

.PHONY: demo test deps configure build bench clean

deps:
	@bash scripts/install-deps.sh

configure: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release > /dev/null

build: configure
	@cmake --build $(BUILD) -j $(JOBS)

demo: build
	@$(BUILD)/tools/mha demo

test: build
	@cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

bench: build
	@$(BUILD)/bench/mha_bench --benchmark_min_time=0.5

clean:
	@rm -rf $(BUILD)
