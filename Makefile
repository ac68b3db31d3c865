# Two entry points (see README): `make run` (main job) and `make test` (whole suite; on a machine with
# nvidia-smi also `make test-gpu`, the tests marked `gpu`, with CUDA visible: docs/gpu_first_hour.md).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# auto: one rank per GPU torch sees (NCCL), else 2 CPU ranks (gloo); a number asks for that many
NPROC ?= auto
export OMP_NUM_THREADS ?= 1
# torch: the CPU-only build unless this machine has an NVIDIA driver (nvidia-smi on PATH); force one
# with `make setup TORCH_BUILD=cpu` or `TORCH_BUILD=cuda`. The CPU wheel is taken from the configured
# sources when they hold it (a local wheel folder), else from PyTorch's CPU index (TORCH_CPU_INDEX);
# PyPI's default Linux wheel is the multi-GB CUDA build. macOS has one build (PyPI's).
TORCH_VERSION := 2.13.0
TORCH_BUILD ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(VENV)/.installed: pyproject.toml
	@case "$(TORCH_BUILD)" in cpu|cuda) ;; *) echo "TORCH_BUILD must be cpu or cuda, got '$(TORCH_BUILD)'"; exit 2;; esac
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@echo "installing torch $(TORCH_VERSION), $(TORCH_BUILD) build (200 MB to a few GB: pip shows the download)"
	@if [ "$(TORCH_BUILD)" = cuda ] || [ "$$(uname -s)" = Darwin ]; then \
		$(PY) -m pip install torch==$(TORCH_VERSION); \
	else \
		$(PY) -m pip install torch==$(TORCH_VERSION)+cpu 2>/dev/null || \
		$(PY) -m pip install torch==$(TORCH_VERSION)+cpu --index-url $(TORCH_CPU_INDEX); \
	fi
	@echo "installing shardwise and what its tests use (transformers, accelerate, peft, trl, datasets, ...)"
	$(PY) -m pip install -q -e '.[test]'
	@$(PY) -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda) if torch.version.cuda else print('torch', torch.__version__, 'CPU build')"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/shardwise launch --nproc $(NPROC)$(if $(BACKEND), --backend $(BACKEND)) -- train --run-config examples/sonnets.toml --resume auto

# Two pytest-xdist workers, whole files to a worker (a file's module fixtures, e.g. one launch shared by its
# tests, run once): on 2 cores one worker's waits (process starts, rendezvous, timeouts under test) are the
# other's CPU time (docs/testing.md). Each worker keeps its own rank pools; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
# The suite starts fresh interpreters (launched ranks, CLI runs): each would compile shardwise's and the
# tests' modules again (~0.2 CPU s measured) where the environment says PYTHONDONTWRITEBYTECODE=1 (this
# machine's does); so they are compiled once first, and the suite may write bytecode (pytest's rewritten tests).
BYTECODE = $(PY) -m compileall -q -j 0 shardwise tests examples benchmarks >/dev/null && PYTHONDONTWRITEBYTECODE=
test: setup
	$(BYTECODE) $(PY) -m pytest -q --durations=15 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests
	@if command -v nvidia-smi >/dev/null 2>&1; then $(MAKE) --no-print-directory test-gpu; fi

# the GPU tier: tests marked `gpu`, CUDA left visible (tests/conftest.py hides it from every other test)
test-gpu: setup
	$(BYTECODE) SHARDWISE_TEST_GPU=1 $(PY) -m pytest -q -m gpu tests

# The inner loop (issue 48): one quick test per package (tests/fast_subset.py), a minute or two; CI runs `make test`.
test-fast: setup
	$(BYTECODE) $(PY) -m pytest -q -m fast --durations=5 tests
.PHONY: test-fast

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m pip install -q deepspeed==0.19.8
	$(PY) benchmarks/zero/bench_zero.py

.PHONY: setup run test test-gpu lint bench
