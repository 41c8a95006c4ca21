# Every target creates and reuses a local virtualenv (.venv) on first use.
#   make conform   the conformance suite of kda_impl against golden/ (JAX only, no torch)
#   make test      the project's own tests (installs the CPU torch references too), on PYTEST_WORKERS
#                  processes (pytest-xdist; default: the CPU count, at most 4)
# JAX's persistent compilation cache (conformance/compile_cache.py) lives in .cache/jax, or in
# $JAX_COMPILATION_CACHE_DIR (set empty: off): `make conform` after `make test` reuses what the tests compiled.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_EXTRA ?= torch-cpu
export PATH := $(abspath $(VENV))/bin:$(PATH)

DUMPS ?= golden
REPORT_DIR ?= reports
KERNEL ?= auto
OUT ?= dumps/$(PRESET)
PRESET ?= kimi-linear-48b-a3b
REFERENCE ?= transformers
DEVICE ?= cpu
PYTEST_ARGS ?=
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
DUMP_ARGS ?=

.PHONY: conform test test-slow dump golden lint bench conform-full conform-sglang-jax clean-venv device-check

$(VENV)/.core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.full: $(VENV)/.core
	$(PY) -m pip install -q -e '.[$(TORCH_EXTRA),png,dev]'
	touch $@

conform: $(VENV)/.core
	$(PY) -m conformance run --dumps $(DUMPS) --kernel $(KERNEL) --report-dir $(REPORT_DIR)

test: $(VENV)/.full
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

test-slow: $(VENV)/.full
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

dump: $(VENV)/.full
	$(PY) -m dump_gen --out $(OUT) --preset $(PRESET) --reference $(REFERENCE) --device $(DEVICE) $(DUMP_ARGS)

# golden/ stays <= 32 MiB: the float64 truth of the intermediates only for its cases of <= 65 tokens.
golden: $(VENV)/.full
	rm -rf golden.tmp && $(PY) -m dump_gen --out golden.tmp --preset mini --reference transformers --device cpu \
		--truth-intermediates-max-tokens 65
	cp golden/README.md golden.tmp/README.md && rm -rf golden && mv golden.tmp golden

conform-full: $(VENV)/.full
	$(PY) -m dump_gen --out dumps/kimi-linear-48b-a3b --overwrite --preset kimi-linear-48b-a3b --reference transformers --device cpu
	$(PY) -m conformance run --dumps dumps/kimi-linear-48b-a3b --report-dir $(REPORT_DIR)/full-tp1
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m conformance run \
		--dumps dumps/kimi-linear-48b-a3b --tp 4 --report-dir $(REPORT_DIR)/full-tp4

lint: $(VENV)/.full
	pre-commit run --all-files

bench: $(VENV)/.full
	$(PY) -m benchmarks.chunk_margins
	$(PY) -m benchmarks.bench_kernels
	$(PY) -m benchmarks.bench_decode
	$(PY) -m benchmarks.bench_layer
	$(PY) -m benchmarks.bench_search

# On a GPU machine, with the machine's own python (torch, JAX, triton) and the wheels in .whl/; here:
# make device-check DEVICE_CHECK_ARGS=--cpu-smoke PYTHON=.venv/bin/python
device-check:
	PYTHON=$(PYTHON) bash benchmarks/device_check.sh $(DEVICE_CHECK_ARGS)

# Opt-in, not in CI: sglang-jax's KDA (examples/sglang_jax/) on golden/ and on a strong-decay set.
SGLANG_JAX ?=
SGLANG_JAX_RUN = $(PY) -m conformance run --impl examples.sglang_jax.adapter:SglangJaxAdapter \
	--impl-option sglang_jax=$(SGLANG_JAX)
conform-sglang-jax: $(VENV)/.full
	@test -n "$(SGLANG_JAX)" || { echo "give the checkout: make conform-sglang-jax SGLANG_JAX=/path/to/sglang-jax"; exit 2; }
	test -f dumps/stress-mini/manifest.json || $(PY) -m dump_gen --out dumps/stress-mini --preset mini \
		--weights stress --cases T8 T65 varlen_initstate T333 varlen_70_3 --no-progress
	status=0; \
	$(SGLANG_JAX_RUN) --dumps golden --report-dir $(REPORT_DIR)/sglang-jax-golden \
		-- -W ignore::DeprecationWarning || status=1; \
	$(SGLANG_JAX_RUN) --dumps dumps/stress-mini --report-dir $(REPORT_DIR)/sglang-jax-stress \
		-- -W ignore::DeprecationWarning || status=1; \
	exit $$status

clean-venv:
	rm -rf $(VENV)
