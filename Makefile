# The README's two commands: `make run` and `make test`. Each sets up its own virtual environment.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: any other torch requirement pip resolves from scratch pulls GBs of CUDA wheels.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv run test lint typecheck pytest cluster-up cluster-down clean

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
	$(VENV)/bin/mypy orchestrator sharding jobs

pytest: venv
	$(PY) -m pytest $(PYTEST_ARGS)

test: lint typecheck cluster-up pytest

clean:
	rm -rf $(VENV) build *.egg-info
