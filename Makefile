# Two entry points (see README): `make run` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2
export OMP_NUM_THREADS ?= 1

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/shardwise launch --nproc $(NPROC) -- train --run-config examples/sonnets.toml --resume auto

test: setup
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m pip install -q deepspeed==0.19.8
	$(PY) benchmarks/bench_zero.py

.PHONY: setup run test lint bench
