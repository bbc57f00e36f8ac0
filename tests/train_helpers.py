"""How a test starts the training job, and its in-process twin for refusals.

A ``python -m jobs.train`` process costs seconds before its first check (imports, Hydra), and each
rank as much again. A test that only compares an error message needs none of it: ``refusal`` runs
what ``jobs.train`` runs before it submits (Hydra's compose, ``load_config``,
``check_before_submit``) in the test's own process and returns the line ``jobs.train`` would
print. Each entry point keeps one subprocess test of its exit code and one-line format.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import warm_start

# What a test that is not about them can leave off: the memory estimate before submission (a fake-
# tensor step), the telemetry sampler, and TensorBoard's import in rank 0. Their own tests set them.
CHEAP = ("memory.estimate=off", "telemetry.enabled=false", "logger.tensorboard=false")


def train_command(*overrides: str, run_dir: Path | None = None, sweep_dir: Path | None = None,
                  cache_dir: Path | None = None, multirun: bool = False) -> list[str]:
    """``python -m jobs.train [-m] OVERRIDES`` with the run (or sweep) directory and the demo data's
    cache given as paths; None leaves the config's own."""
    args = [sys.executable, "-m", "jobs.train", *(["-m"] if multirun else []), *overrides]
    if cache_dir is not None:
        args.append(f"data.cache_dir={cache_dir}")
    if run_dir is not None:
        args.append(f"hydra.run.dir={run_dir}")
    if sweep_dir is not None:
        args.append(f"hydra.sweep.dir={sweep_dir}")
    return args


def run_train(*overrides: str, run_dir: Path | None = None, sweep_dir: Path | None = None,
              cache_dir: Path | None = None, multirun: bool = False, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, timeout: float = 600, cold: bool = False,
              ) -> subprocess.CompletedProcess[str]:
    """Run ``train_command(...)`` to its end, as ``subprocess.run(capture_output=True, text=True)``
    would; ``env`` adds to (or overrides) this environment. The process is forked from a warm one
    where nothing it could see differs (``warm_start``); ``cold=True`` starts a new interpreter,
    for the tests of what happens before and during its imports."""
    command = train_command(*overrides, run_dir=run_dir, sweep_dir=sweep_dir, cache_dir=cache_dir,
                            multirun=multirun)
    full_env = {**os.environ, **(env or {})}
    if cold:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=full_env)
    return warm_start.run_module("jobs.train", command[3:], cwd=cwd, env=full_env, timeout=timeout)


def refusal(*overrides: str, run_dir: Path | None = None) -> str:
    """The ``error: ...`` line ``python -m jobs.train OVERRIDES`` prints before submitting, found in
    this process; AssertionError if the config passes every check. ``run_dir``: check the resume the
    ranks would make from it too, as ``jobs.train`` does with ``hydra.run.dir``."""
    from hydra import compose, initialize_config_module

    from jobs.train import check_before_submit, load_config
    from orchestrator.config import ConfigError
    from orchestrator.terminal import printable

    with initialize_config_module(config_module="conf", version_base="1.3"):
        composed = compose(config_name="train", overrides=list(overrides))
    try:
        check_before_submit(load_config(composed), run_dir)
    except ConfigError as e:
        return f"error: {printable(e)}"
    raise AssertionError(f"jobs.train would submit {' '.join(overrides)}: nothing refused it")
