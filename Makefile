# The README's two commands: `make run` and `make test`. Each sets up its own virtual environment.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: any other torch requirement pip resolves from scratch pulls GBs of CUDA wheels.
TORCH_PIN ?= torch==2.13.0

.PHONY: venv run test lint typecheck docs pytest cluster-up cluster-down clean gpu-deps gpu-check

$(PY):
	python3 -m venv $(VENV)

# Everything with uv, torch included, which resolves, unpacks and compiles in parallel. pip's
# configuration names where this machine keeps its CPU wheel of torch (find-links); uv reads no
# pip configuration, so it is handed the same folders. With uv's cache empty, as on a new CI
# machine, a new venv takes 41 s on the 2-core machine, against 51 s when pip installed torch first
# (unpacking and compiling it on one core) and 94 s with pip alone. The torch pin is uv's
# constraint too, so no package can pull a CUDA build of torch. --compile-bytecode: where
# PYTHONDONTWRITEBYTECODE is set nothing would write it later, and every process would compile
# what it imports.
FIND_LINKS = $(foreach dir,$(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null)),--find-links $(dir))
$(VENV)/.installed: $(PY) setup.cfg pyproject.toml
	$(PY) -m pip install -q uv
	echo '$(TORCH_PIN)' > $(VENV)/constraints.txt
	$(VENV)/bin/uv pip install -q --python $(PY) $(FIND_LINKS) --compile-bytecode -c $(VENV)/constraints.txt \
		'$(TORCH_PIN)' -e '.[test,docs]'
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
	$(VENV)/bin/mypy orchestrator sharding durable jobs switchyard

# The docs site (mkdocs.yml) into site/; --strict: a broken link or anchor, or a page missing from the
# navigation, fails it.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# Four pytest-xdist workers on two cores: a SLURM test spends much of its time waiting for the
# scheduler, and the others fill that (with three, the cores still idled 110 s of a run, when
# every worker waited on SLURM at once; with four, 39 s). Each module is a group (its fixtures run
# once); the SLURM modules go first, on every worker at once (tests/conftest.py,
# docs/development.md). --durations: the 25 slowest, where the suite's time goes.
PYTEST_ARGS ?= -n 4 --dist loadgroup --durations=25

# The project's bytecode, compiled once before the suite: where PYTHONDONTWRITEBYTECODE is set (it is
# on this project's CI machines) no process writes it, so each of the ~700 processes the suite starts
# compiled every Switchyard module it imports from source (0.17 s of CPU each). A stale file is
# never used: Python checks each against its source.
BYTECODE_DIRS := orchestrator sharding durable jobs switchyard conf hydra_plugins tests bench

pytest: venv
	$(PY) -m compileall -q -j 0 $(BYTECODE_DIRS) > /dev/null
	$(PY) -m pytest $(PYTEST_ARGS)

# The cluster comes up while the venv is built: `python3 -m orchestrator.localcluster` needs only
# the standard library, and on a new machine `up` spends its first ~20 s in apt-get (SLURM's and
# MariaDB's packages), as the venv does in pip and uv: one waited for the other. Its output is
# printed once the venv is ready.
# ruff, mypy and the docs build run beside the suite: mypy alone is 23 s of one core, which the
# sequence lint -> typecheck -> docs -> cluster-up left the other core idle through before pytest
# started. Their output comes after pytest's (they finish first; a failure is at the end of the log
# either way), and any failure fails make test. Each also runs alone: make lint, make typecheck.
test:
	@up_log=$$(mktemp); python3 -m orchestrator.localcluster up > $$up_log 2>&1 & up=$$!; \
	$(MAKE) --no-print-directory venv; built=$$?; wait $$up; upped=$$?; cat $$up_log; rm -f $$up_log; \
	if (( built || upped )); then exit 1; fi; \
	$(MAKE) --no-print-directory -j 3 --output-sync=target lint typecheck docs > $(VENV)/checks.log 2>&1 & \
	checks=$$!; $(MAKE) --no-print-directory pytest; tests=$$?; \
	wait $$checks; checked=$$?; echo "--- make lint typecheck docs:"; cat $(VENV)/checks.log; \
	exit $$(( tests || checked ))

# On a GPU node: its own python with torch and numpy (no venv, no package index needed). Everything
# else jobs.train imports comes from GPU_DEPS, filled by `make gpu-deps` wherever PyPI is reachable:
# wheels for the node's python (GPU_PY_VERSION; the lent H100s run 3.12) with what they need, never
# torch or numpy (the node's own must win). antlr4 4.9.3 is pure Python and published as a source
# archive only, so it is built here for any version.
GPU_PY ?= python3
GPU_DEPS ?= .gpu-deps
GPU_PY_VERSION ?= $(shell $(GPU_PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
	--platform manylinux2014_x86_64 --platform manylinux1_x86_64
GPU_WHEELS ?= submitit cloudpickle typing_extensions hydra-core omegaconf==2.3.0 PyYAML packaging \
	nvidia-ml-py xxhash tqdm psutil pytest pluggy iniconfig pytest-timeout

gpu-deps:
	rm -rf $(GPU_DEPS)
	python3 -m pip install -q --no-deps --no-compile --target $(GPU_DEPS) antlr4-python3-runtime==4.9.3
	python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --implementation cp \
		--python-version $(GPU_PY_VERSION) $(GPU_PLATFORMS) --target $(GPU_DEPS) $(GPU_WHEELS)

gpu-check:
	PYTHONPATH=$(abspath $(GPU_DEPS))$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
