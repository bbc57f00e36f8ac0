"""A hyperparameter search on the real local cluster: each trial a SLURM job, ASHA cancelling a
bad one with scancel, the registry saying PRUNED where SLURM says CANCELLED."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import CHEAP

from orchestrator.launch import slurm_query
from orchestrator.registry.db import Registry

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]


def test_a_search_runs_its_trials_as_slurm_jobs_and_prunes_with_scancel(tmp_path: Path, queued: list[str]
                                                                        ) -> None:
    """The random sampler's seed 45 asks lr 0.27, 0.008, 0.00095, 0.00019: trials 2 and 3 start once
    trial 0 or 1 has ended, so trial 0 (the good one) passed the first rung before them, and ASHA
    stops both there. Trial 1 runs beside trial 0: pruned if it reaches the first rung after it."""
    env = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "jobs.train", "-m", "hydra/sweeper=switchyard_optuna", "cluster=slurm",
               "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2", "hydra.sweeper.pruner=asha",
               "hydra.sweeper.sampler=random", "hydra.sweeper.seed=45", "hydra.sweeper.poll_s=0.5",
               "optim.lr=tag(log, interval(1e-4, 0.3))", "model=custom",
               "model._target_=search_helpers.Scalar", "task=custom",
               "task._target_=search_helpers.Quadratic",
               "optim=sgd", "optim.momentum=0", "parallelism.procs_per_node=1", *CHEAP, "optim.max_steps=40",
               "eval_every_steps=4", "+model.delay_s=0.1", f"data.cache_dir={tmp_path / 'data'}",
               f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    finally:
        with Registry(tmp_path / "registry.db") as registry:
            ids = [a.slurm_id for s in registry.sweeps() for a in registry.attempts(s.id) if a.slurm_id]
        queued.extend(ids)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with Registry(tmp_path / "registry.db") as registry:
        (sweep,) = registry.sweeps()
        trials = registry.trials(sweep.id)
        attempts = registry.latest_attempts(sweep.id)
    assert sweep.executor == "slurm"
    assert [t.state for t in trials[::2]] == ["COMPLETED", "PRUNED"], proc.stdout
    assert trials[1].state in ("COMPLETED", "PRUNED") and trials[3].state == "PRUNED", proc.stdout
    sacct = slurm_query.wait_for_terminal_states([str(attempts[n].slurm_id) for n in range(4)])
    for trial in (t for t in trials if t.state == "PRUNED"):
        assert trial.step is not None and trial.step < 40
        assert attempts[trial.num].state == "PRUNED"  # what sacct calls CANCELLED
        assert sacct[str(attempts[trial.num].slurm_id)].startswith("CANCELLED")
        assert list((tmp_path / "sweep" / str(trial.num) / "checkpoints").glob("step-*.pt"))
    assert all(sacct[str(attempts[t.num].slurm_id)] == "COMPLETED" for t in trials if t.state == "COMPLETED")
