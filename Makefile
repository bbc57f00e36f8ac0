# The README's two commands: `make run` and `make test`. Each sets up its own virtual environment.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: any other torch requirement pip resolves from scratch pulls GBs of CUDA wheels.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv run test lint typecheck pytest cluster-up cluster-down clean gpu-deps gpu-check

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

run: venv
	$(PY) -m jobs.train

cluster-up: venv
	$(VENV)/bin/switchyard cluster up

cluster-down: venv
	$(VENV)/bin/switchyard cluster down

lint: venv
	$(VENV)/bin/ruff check .

typecheck: venv
	$(VENV)/bin/mypy orchestrator sharding jobs switchyard

pytest: venv
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck cluster-up pytest

# On a GPU node: its own python with torch (no venv, no package index needed). The pure-Python
# packages it may lack come from GPU_DEPS, filled by `make gpu-deps` wherever PyPI is reachable.
GPU_PY ?= python3
GPU_DEPS ?= .gpu-deps
GPU_DEP_PINS ?= submitit hydra-core omegaconf==2.3.0 antlr4-python3-runtime==4.9.3

gpu-deps:
	python3 -m pip install -q --no-deps --no-compile --target $(GPU_DEPS) $(GPU_DEP_PINS)

gpu-check:
	PYTHONPATH=$(abspath $(GPU_DEPS))$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
