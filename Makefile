# Every target creates and reuses a local virtualenv (.venv) on first use.
#   make conform   the conformance suite of kda_impl against golden/ and golden-glm5-next/ (JAX only, no
#                  torch); DUMPS= checks that one set instead
#   make fla-tests FLA=PATH  fla's KDA tests, forward and backward (an fla checkout), on kda_impl (KERNEL=)
#   make test      the project's own tests (installs the CPU torch references too), on PYTEST_WORKERS
#                  processes (pytest-xdist; default: the CPU count, at most 4)
# Each target installs the extras of this host's platform, PLATFORM=cpu|tpu|cuda, detected
# (conformance/runtime/host_platform.py) unless given, with the exact pins of constraints.txt; DUMPS= or OUT= a
# gs:// URL installs the gcs extra too. docs/platforms.md has the commands per platform.
# JAX's persistent compilation cache (conformance/runtime/compile_cache.py) lives in
# $XDG_CACHE_HOME/kda-conformance/jax (else ~/.cache/kda-conformance/jax), or in $JAX_COMPILATION_CACHE_DIR
# (set empty: off): `make conform` after `make test` reuses what the tests compiled.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

ifeq ($(origin PLATFORM),undefined)
PLATFORM_SOURCE := $(shell $(PYTHON) -m conformance.runtime.host_platform --explain)
PLATFORM := $(firstword $(subst :, ,$(PLATFORM_SOURCE)))
else
PLATFORM_SOURCE := $(PLATFORM): as given
endif
ifeq ($(filter $(PLATFORM),cpu tpu cuda),)
$(error PLATFORM=$(PLATFORM) is not one of cpu tpu cuda)
endif
JAX_EXTRAS_cpu := kda-impl
JAX_EXTRAS_tpu := kda-impl,tpu
JAX_EXTRAS_cuda := kda-impl,cuda
TORCH_EXTRA_cpu := torch-cpu
TORCH_EXTRA_tpu := torch-cpu
TORCH_EXTRA_cuda := torch-gpu
JAX_EXTRAS := $(JAX_EXTRAS_$(PLATFORM))
TORCH_EXTRA ?= $(TORCH_EXTRA_$(PLATFORM))
PIP_INSTALL := $(PY) -m pip install -q -c constraints.txt
# libtpu for `make test`'s deviceless TPU compile (tests/kda_impl/test_tpu_compile.py), in a folder of
# its own: in site-packages every JAX process of the tests would look for a TPU.
LIBTPU_DIR := $(VENV)/libtpu

# `make conform` checks both committed sets unless DUMPS= names one.
DUMPS_GIVEN := $(filter-out undefined,$(origin DUMPS))
DUMPS ?= golden
GLM_GOLDEN := golden-glm5-next
REPORT_DIR ?= reports
KERNEL ?= auto
OUT ?= dumps/$(PRESET)
PRESET ?= kimi-linear-48b-a3b
REFERENCE ?= transformers
DEVICE ?= $(if $(filter cuda,$(PLATFORM)),cuda,cpu)
PYTEST_ARGS ?=
PYTEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))
DUMP_ARGS ?=
GCS_FOR_DUMPS := $(if $(filter gs://%,$(DUMPS)),$(VENV)/.gcs)
GCS_FOR_OUT := $(if $(filter gs://%,$(OUT)),$(VENV)/.gcs)

.PHONY: conform test test-slow fla-tests dump golden golden-glm5-next goldens lint bench split-curve \
	conform-full conform-sglang-jax clean-venv device-check

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.core-$(PLATFORM): pyproject.toml constraints.txt | $(PY)
	@echo "platform $(PLATFORM_SOURCE); installing .[$(JAX_EXTRAS)]"
	$(PIP_INSTALL) -e '.[$(JAX_EXTRAS)]'
	touch $@

$(VENV)/.full-$(PLATFORM): $(VENV)/.core-$(PLATFORM)
	$(PIP_INSTALL) -e '.[$(JAX_EXTRAS),$(TORCH_EXTRA),png,dev]'
	touch $@

# The torch references alone, for `make dump` (on an H100: torch-gpu, no JAX CUDA stack beside it).
$(VENV)/.torch-$(PLATFORM): pyproject.toml constraints.txt | $(PY)
	@echo "platform $(PLATFORM_SOURCE); installing .[$(TORCH_EXTRA)]"
	$(PIP_INSTALL) -e '.[$(TORCH_EXTRA)]'
	touch $@

$(VENV)/.gcs: pyproject.toml constraints.txt | $(PY)
	$(PIP_INSTALL) -e '.[gcs]'
	touch $@

$(LIBTPU_DIR)/.installed: constraints.txt | $(PY)
	rm -rf $(LIBTPU_DIR)
	$(PIP_INSTALL) --no-deps --target $(LIBTPU_DIR) libtpu
	touch $@

# Both sets run at once, in two processes (on a cold cache most of a run is XLA compiling on one core);
# the exit status is 1 if either failed. golden's output streams; golden-glm5-next's, held in
# $(REPORT_DIR)/golden-glm5-next.log meanwhile, follows it; its reports go to $(REPORT_DIR)/golden-glm5-next.
# GLM_CONFORM_ARGS: more options of its run (e.g. --dtypes fp32).
GLM_CONFORM_ARGS ?=
GLM_LOG = $(REPORT_DIR)/$(GLM_GOLDEN).log
conform: $(VENV)/.core-$(PLATFORM) $(GCS_FOR_DUMPS)
	status=0; \
	$(if $(DUMPS_GIVEN),,mkdir -p $(REPORT_DIR) && { $(PY) -m conformance run --dumps $(GLM_GOLDEN) $(GLM_CONFORM_ARGS) \
		--kernel $(KERNEL) --report-dir $(REPORT_DIR)/$(GLM_GOLDEN) > $(GLM_LOG) 2>&1 & glm=$$!; };) \
	$(PY) -m conformance run --dumps $(DUMPS) --kernel $(KERNEL) --report-dir $(REPORT_DIR) || status=1; \
	$(if $(DUMPS_GIVEN),,wait $$glm || status=1; echo "--- $(GLM_GOLDEN) ($(GLM_LOG))"; cat $(GLM_LOG);) \
	exit $$status

test: $(VENV)/.full-$(PLATFORM) $(LIBTPU_DIR)/.installed
	KDA_LIBTPU_PATH=$(abspath $(LIBTPU_DIR)) $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# fla's own KDA tests (tests/ops/test_kda.py of an fla checkout FLA=PATH), forward and backward checks, on
# kda_impl's kernels, KERNEL=naive|pallas (Pallas in interpret mode off TPU; the backward is plain JAX's);
# tests/fla_shim, docs/kernels.md.
fla-tests: $(VENV)/.full-$(PLATFORM)
	@test -n "$(FLA)" || { echo "make fla-tests needs FLA=PATH, an fla checkout"; exit 2; }
	$(PY) -m tests.fla_shim --fla $(FLA) --kernel $(if $(filter auto,$(KERNEL)),naive,$(KERNEL)) $(PYTEST_ARGS)

# The long real-size runs (tests/test_real_size.py, marked slow): what conform-full does, as tests.
test-slow: $(VENV)/.full-$(PLATFORM)
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

dump: $(VENV)/.torch-$(PLATFORM) $(GCS_FOR_OUT)
	$(PY) -m dump_gen --out $(OUT) --preset $(PRESET) --reference $(REFERENCE) --device $(DEVICE) $(DUMP_ARGS)

# golden/ stays <= 32 MiB: the float64 truth of the intermediates only for its cases of <= 65 tokens, the
# reference's gradients for T65 alone (a set's 65-token case with them is 1.3 MiB more).
golden: $(VENV)/.full-$(PLATFORM)
	rm -rf golden.tmp && $(PY) -m dump_gen --out golden.tmp --preset mini --reference transformers --device cpu \
		--truth-intermediates-max-tokens 65 --gradient-cases T65
	cp golden/README.md golden.tmp/README.md && rm -rf golden && mv golden.tmp golden

# golden-glm5-next/ (< 15 MiB, checked by `make conform` beside golden/): the glm5-next layer with the
# stress weights (every 4th channel's gate at its floor L), two cases: a packed batch with initial states
# and a one-token (decode) sequence, and a packed boundary inside the second 64-token chunk; the reference's
# gradients of the second (each case file under 4 MiB).
GLM_GOLDEN_CASES := varlen_initstate varlen_70_3
golden-glm5-next: $(VENV)/.full-$(PLATFORM)
	rm -rf $(GLM_GOLDEN).tmp && $(PY) -m dump_gen --out $(GLM_GOLDEN).tmp --preset glm5-next-mini --weights stress \
		--reference transformers --device cpu --cases $(GLM_GOLDEN_CASES) \
		--gradient-cases varlen_70_3
	cp $(GLM_GOLDEN)/README.md $(GLM_GOLDEN).tmp/README.md && rm -rf $(GLM_GOLDEN) && mv $(GLM_GOLDEN).tmp $(GLM_GOLDEN)

# Both committed sets, one after the other.
goldens: golden golden-glm5-next

conform-full: $(VENV)/.full-$(PLATFORM)
	$(PY) -m dump_gen --out dumps/kimi-linear-48b-a3b --overwrite --preset kimi-linear-48b-a3b --reference transformers --device cpu
	$(PY) -m conformance run --dumps dumps/kimi-linear-48b-a3b --report-dir $(REPORT_DIR)/full-tp1
	XLA_FLAGS=--xla_force_host_platform_device_count=8 $(PY) -m conformance run \
		--dumps dumps/kimi-linear-48b-a3b --tp 4 --report-dir $(REPORT_DIR)/full-tp4

lint: $(VENV)/.full-$(PLATFORM)
	pre-commit run --all-files

bench: $(VENV)/.full-$(PLATFORM)
	$(PY) -m benchmarks.chunk_margins
	$(PY) -m benchmarks.bench_kernels
	$(PY) -m benchmarks.bench_decode
	$(PY) -m benchmarks.bench_layer
	$(PY) -m benchmarks.bench_search

# The split curve (benchmarks/split_curve.py): the real-size layer's bf16 error against the float64 truth
# and against its unsplit prefill, for a prefill of SPLIT_CURVE_TOKENS tokens in pieces of 64..512;
# kda_impl, and sglang-jax's too with SGLANG_JAX=/path/to/sglang-jax. A table and a plot in
# $(REPORT_DIR)/split-curve; minutes on a CPU (sglang-jax's Pallas kernels are interpreted there).
SPLIT_CURVE_TOKENS ?= 1024
split-curve: $(VENV)/.full-$(PLATFORM)
	$(PY) -W ignore::DeprecationWarning -m benchmarks.split_curve --tokens $(SPLIT_CURVE_TOKENS) \
		--out $(REPORT_DIR)/split-curve $(if $(SGLANG_JAX),--impl kda_impl $(SGLANG_JAX_IMPL))

# On a GPU machine, with the machine's own python (torch, JAX, triton) and the wheels in .whl/; here:
# make device-check DEVICE_CHECK_ARGS=--cpu-smoke PYTHON=.venv/bin/python
device-check:
	PYTHON=$(PYTHON) bash benchmarks/device_check.sh $(DEVICE_CHECK_ARGS)

# Opt-in, not in CI: sglang-jax's KDA (examples/sglang_jax/) on golden/, then `conformance search` on it
# (no hand-made set: generated cases, seed 0, 600 s to find, up to 1200 s to shrink, as each new shape
# compiles on a CPU) and the suite's run of the reproducer it writes. Exit status 1 when any of them
# failed (sglang-jax does: examples/sglang_jax/README.md). The golden/ run includes the fixed serving
# scenarios (the suite checks them with every case of a set); no serving search runs here.
SGLANG_JAX ?=
SGLANG_JAX_SEARCH_BUDGET ?= 600
SGLANG_JAX_SHRINK_BUDGET ?= 1200
SGLANG_JAX_IMPL = --impl examples.sglang_jax.adapter:SglangJaxAdapter --impl-option sglang_jax=$(SGLANG_JAX)
SGLANG_JAX_RUN = $(PY) -m conformance run $(SGLANG_JAX_IMPL)
SGLANG_JAX_SEARCH_OUT = $(REPORT_DIR)/sglang-jax-search
conform-sglang-jax: $(VENV)/.full-$(PLATFORM)
	@test -n "$(SGLANG_JAX)" || { echo "give the checkout: make conform-sglang-jax SGLANG_JAX=/path/to/sglang-jax"; exit 2; }
	status=0; \
	$(SGLANG_JAX_RUN) --dumps golden --report-dir $(REPORT_DIR)/sglang-jax-golden \
		-- -W ignore::DeprecationWarning || status=1; \
	rm -rf $(SGLANG_JAX_SEARCH_OUT); \
	$(PY) -W ignore::DeprecationWarning -m conformance search $(SGLANG_JAX_IMPL) --preset mini --dtypes fp32 \
		--seed 0 --budget $(SGLANG_JAX_SEARCH_BUDGET) --shrink-budget $(SGLANG_JAX_SHRINK_BUDGET) \
		--out $(SGLANG_JAX_SEARCH_OUT) || status=1; \
	if test -f $(SGLANG_JAX_SEARCH_OUT)/reproducer/manifest.json; then \
		$(SGLANG_JAX_RUN) --dumps $(SGLANG_JAX_SEARCH_OUT)/reproducer --dtypes fp32 \
			--report-dir $(REPORT_DIR)/sglang-jax-reproducer -- -W ignore::DeprecationWarning || status=1; \
	fi; \
	exit $$status

clean-venv:
	rm -rf $(VENV)
