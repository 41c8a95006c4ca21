# Every target creates and reuses a local virtualenv (.venv) on first use.
#   make conform   the conformance suite of kda_impl against golden/ (JAX only, no torch)
#   make test      the project's own tests (installs the CPU torch references too)
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
DUMP_ARGS ?=

.PHONY: conform test test-slow dump golden lint bench conform-full clean-venv

$(VENV)/.core: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.full: $(VENV)/.core
	$(PY) -m pip install -q -e '.[$(TORCH_EXTRA),dev]'
	touch $@

conform: $(VENV)/.core
	$(PY) -m conformance run --dumps $(DUMPS) --kernel $(KERNEL) --report-dir $(REPORT_DIR)

test: $(VENV)/.full
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(VENV)/.full
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

dump: $(VENV)/.full
	$(PY) -m dump_gen --out $(OUT) --preset $(PRESET) --reference $(REFERENCE) --device $(DEVICE) $(DUMP_ARGS)

golden: $(VENV)/.full
	rm -rf golden.tmp && $(PY) -m dump_gen --out golden.tmp --preset mini --reference transformers --device cpu
	cp golden/README.md golden.tmp/README.md && rm -rf golden && mv golden.tmp golden

conform-full: $(VENV)/.full
	$(PY) -m dump_gen --out dumps/kimi-linear-48b-a3b --preset kimi-linear-48b-a3b --reference transformers --device cpu
	$(PY) -m conformance run --dumps dumps/kimi-linear-48b-a3b --report-dir $(REPORT_DIR)/full-tp1
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m conformance run \
		--dumps dumps/kimi-linear-48b-a3b --tp 4 --report-dir $(REPORT_DIR)/full-tp4

lint: $(VENV)/.full
	pre-commit run --all-files

bench: $(VENV)/.full
	$(PY) -m benchmarks.bench_kernels
	$(PY) -m benchmarks.bench_layer

clean-venv:
	rm -rf $(VENV)
