"""What a resume continues from and what it may change (``orchestrator.training.resume``), on a real
one-rank process group: another run's checkpoints only when named (``checkpoint.resume_from``), a
checkpoint directory locked like the run directory, a changed lr and schedule really used, a changed
seed or ``max_steps`` below the checkpoint refused before submission and on the ranks, and one
definition of ``samples_per_rank`` across a same-size and an elastic resume."""

from __future__ import annotations

import dataclasses
import io
import math
from pathlib import Path
from typing import Any

import pytest
from rank_helpers import write_rows_dataset

from jobs import train as train_job
from orchestrator.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    LoggerConfig,
    MlpConfig,
    OptimConfig,
    TelemetryConfig,
    TrainConfig,
)
from orchestrator.launch import run_lock
from orchestrator.registry.db import Job, Registry
from orchestrator.sweeps.status import cmd_show
from orchestrator.training import checks, rank_process, resume, runtime, trainer
from orchestrator.training.checkpoint import CheckpointError


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> trainer.DataPaths:
    path = write_rows_dataset(tmp_path_factory.mktemp("data") / "d", 64, features=5, classes=3, max_rows=4)
    return trainer.DataPaths(train=path, eval=None)


def config(data: trainer.DataPaths, checkpoints: Path | None = None, resume_from: Path | None = None,
           seed: int = 0, **optim: Any) -> TrainConfig:
    return TrainConfig(
        model=MlpConfig(), data=DataConfig(path=data.train, num_classes=3, batch_size=4), seed=seed,
        optim=OptimConfig(**{"max_steps": 4, **optim}), log_every_steps=2,
        checkpoint=CheckpointConfig(dir=str(checkpoints) if checkpoints else None,
                                    resume_from=str(resume_from) if resume_from else None),
        logger=LoggerConfig(tensorboard=False), telemetry=TelemetryConfig(enabled=False))


def train(rt: runtime.Runtime, data: trainer.DataPaths, run: Path, cfg: TrainConfig) -> dict[str, Any]:
    run.mkdir(exist_ok=True)  # Hydra makes a run's directory before it starts
    return trainer.Trainer(cfg, data, run, rt).run()


def refused_before_submission(cfg: TrainConfig, data: trainer.DataPaths, run: Path, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        checks.check_before_submit(cfg, data, run)


def test_a_changed_lr_and_schedule_are_the_ones_used_after_a_resume(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue: the optimizer's restored state brought the checkpoint's lr back, while the run's
    config recorded the new one."""
    run = tmp_path / "run"
    train(rank, data, run, config(data, lr=0.1, schedule="cosine"))
    resumed = trainer.Trainer(config(data, lr=0.01, schedule="cosine", max_steps=8), data, run, rank)
    used: list[float] = []
    step = resumed.optimizer.step

    def recording(*args: Any, **kwargs: Any) -> Any:
        used.append(resumed.optimizer.param_groups[0]["lr"])
        return step(*args, **kwargs)

    monkeypatch.setattr(resumed.optimizer, "step", recording)
    summary = resumed.run()
    assert summary["resumed_from"]["step"] == 4 and summary["steps"] == 8
    assert used == pytest.approx([0.01 * 0.5 * (1 + math.cos(math.pi * s / 8)) for s in range(4, 8)])
    assert summary["resumed_from"]["config_changes"] == {"optim.lr": [0.1, 0.01], "optim.max_steps": [4, 8]}


def test_the_changes_applied_at_a_resume_are_told_where_the_user_looks(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The issue: only rank 0's log named them; the submitting terminal said only 'resumed from ...
    at step N', and `switchyard show` nothing."""
    run = tmp_path / "run"
    train(rank, data, run, config(data, lr=0.1))
    summary = train(rank, data, run, config(data, lr=0.01, max_steps=6))
    capsys.readouterr()  # rank 0's own lines
    told = [f"resumed from {run / 'checkpoints' / 'step-000000004.pt'} at step 4",
            "changed at resume, now applied: optim.lr 0.1 -> 0.01, optim.max_steps 4 -> 6"]
    train_job.report(summary, run)  # the submitting side of a blocking python -m jobs.train
    assert capsys.readouterr().out.splitlines()[:2] == told
    rank_process.write_summary(run, summary)  # as train_rank's rank 0 does
    registry = Registry(tmp_path / "r.db")
    sweep = registry.create_sweep("train", "optim.lr=0.01", str(tmp_path), "slurm", "entry")
    registry.add_jobs([Job(sweep, 0, ["optim.lr=0.01"], str(run), {}, 6)])
    out = io.StringIO()
    assert cmd_show(registry, f"{sweep}/0", as_json=False, out=out) == 0
    assert "\n".join(told) in out.getvalue()


def test_a_changed_seed_is_refused_before_submission_and_on_the_ranks(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path) -> None:
    """It failed on the ranks, with the sampler's advice about set_epoch that no user can follow."""
    run = tmp_path / "run"
    train(rank, data, run, config(data))
    changed = config(data, seed=1, max_steps=8)
    refused_before_submission(changed, data, run, r"seed: checkpoint 0, now 1")
    with pytest.raises(CheckpointError, match=r"seed: checkpoint 0, now 1\nResume with the checkpoint's"):
        trainer.Trainer(changed, data, run, rank).run()


def test_max_steps_below_the_checkpoint_is_refused(rank: runtime.Runtime, data: trainer.DataPaths,
                                                   tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(rank, data, run, config(data))
    refused_before_submission(config(data, max_steps=2), data, run, r"optim.max_steps=2 is below its step 4")
    with pytest.raises(CheckpointError, match=r"optim.max_steps=2 is below its step 4"):
        trainer.Trainer(config(data, max_steps=2), data, run, rank).run()


def test_another_runs_checkpoints_are_resumed_only_when_named(rank: runtime.Runtime, data: trainer.DataPaths,
                                                              tmp_path: Path) -> None:
    """The issue: run b, given run a's checkpoint.dir, 'resumed from' a's last step and reported it."""
    shared, a, b = tmp_path / "shared", tmp_path / "a", tmp_path / "b"
    train(rank, data, a, config(data, shared))
    merged = config(data, shared, lr=1e-2, max_steps=8)
    both = (rf"written by hydra.run.dir='{a}'\), not of this run \(hydra.run.dir='{b}'\)"
            rf".*checkpoint.resume_from='{shared}'")
    refused_before_submission(merged, data, b, both)
    with pytest.raises(CheckpointError, match=both):
        train(rank, data, b, merged)
    assert sorted(p.name for p in shared.glob("step-*.pt")) == ["step-000000004.pt"]

    named = config(data, resume_from=shared, max_steps=8)  # b's checkpoints go to b/checkpoints
    checks.check_before_submit(named, data, b)
    done = train(rank, data, b, named)
    assert done["resumed_from"]["run_dir"] == str(a) and done["resumed_from"]["resume_from"] == str(shared)
    assert done["steps"] == 8 and (b / "checkpoints" / "step-000000008.pt").exists()
    requeued = train(rank, data, b, dataclasses.replace(named, optim=OptimConfig(max_steps=12)))
    assert requeued["resumed_from"]["path"] == str(b / "checkpoints" / "step-000000008.pt")  # its own
    assert requeued["resumed_from"]["resume_from"] is None

    one = config(data, resume_from=shared / "step-000000004.pt", max_steps=6)  # a checkpoint file
    assert train(rank, data, tmp_path / "c", one)["resumed_from"]["step"] == 4
    refused_before_submission(config(data, resume_from=tmp_path / "nothing"), data, tmp_path / "d",
                              r"checkpoint.resume_from='.*nothing' holds no readable checkpoint")
    refused_before_submission(config(data, shared, resume_from=b / "checkpoints"), data, tmp_path / "e",
                              r"this run's saves would be pruned and resumed among them")


def test_a_resume_from_an_older_step_inside_another_runs_checkpoint_dir_is_refused(
        rank: runtime.Runtime, data: trainer.DataPaths, tmp_path: Path) -> None:
    """The issue: run b (checkpoint.dir=a's, resume_from=a's step 1, keep_last=2) exited 0 having
    deleted a's older steps and replaced a's step 3 with its own."""
    shared, a, b = tmp_path / "a" / "checkpoints", tmp_path / "a", tmp_path / "b"
    train(rank, data, a, dataclasses.replace(config(data, shared), checkpoint=CheckpointConfig(
        dir=str(shared), every_steps=1, keep_last=4)))
    before = {p.name: p.read_bytes() for p in shared.iterdir()}
    assert sorted(p.name for p in shared.glob("step-*.pt"))[0] == "step-000000001.pt"
    b_cfg = dataclasses.replace(config(data, shared, lr=1e-2, max_steps=8), checkpoint=CheckpointConfig(
        dir=str(shared), resume_from=str(shared / "step-000000001.pt"), every_steps=1, keep_last=2))
    both = (rf"written by hydra.run.dir='{a}'\), not of this run \(hydra.run.dir='{b}'\).*"
            rf"leave checkpoint.dir unset.*hydra.run.dir='{a}'")
    refused_before_submission(b_cfg, data, b, both)
    with pytest.raises(CheckpointError, match=both):
        train(rank, data, b, b_cfg)
    assert {p.name: p.read_bytes() for p in shared.iterdir()} == before


def test_a_checkpoint_dir_in_use_is_refused_at_submission_and_on_the_ranks(
        data: trainer.DataPaths, tmp_path: Path) -> None:
    """Two runs started 2 s apart both wrote into one checkpoint.dir: the lock covered the run
    directory only."""
    shared = tmp_path / "shared"
    cfg = config(data, shared)
    with run_lock.hold(shared, "job 41 (rank 0, pid 7 on n1)", "checkpoint.dir"):
        in_use = rf"checkpoint.dir='{shared}' is in use by job 41 \(rank 0, pid 7 on n1\)"
        with pytest.raises(run_lock.RunDirInUseError, match=in_use):
            train_job.run(cfg, tmp_path / "b")
        with pytest.raises(run_lock.RunDirInUseError, match=in_use):
            rank_process.train_rank(cfg, data, str(tmp_path / "c"))


def test_counts_since_step_0_on_the_same_world_size_and_on_another() -> None:
    old = [{"samples": 10, "units": 40, "batches": 3}, {"samples": 9, "units": 36, "batches": 3}]
    assert resume.carried_counts(old, 2, 1) == resume.Counts(9, 36, 3)  # its own
    assert resume.carried_counts(old, 1, 0) == resume.Counts(19, 76, 3)  # the run's total
    thirds = [resume.carried_counts(old, 3, r) for r in range(3)]
    assert [c.samples for c in thirds] == [7, 6, 6] and sum(c.units for c in thirds) == 76
    assert {c.batches for c in thirds} == {3}


def test_a_step_across_an_epochs_end_resumes_at_the_next_untrained_sample(
        rank: runtime.Runtime, tmp_path: Path) -> None:
    """7 batches an epoch, 2 micro-batches a step: step 4 trains the epoch's last batch and the next
    epoch's first. The saved position must be one batch into the new epoch, not two (the whole step
    counted there), or a resume skips a batch that was never trained on."""
    path = write_rows_dataset(tmp_path / "d", 7 * 4, features=5, classes=3, max_rows=4)
    paths = trainer.DataPaths(train=path, eval=None)
    cfg = dataclasses.replace(config(paths, grad_accum_steps=2, max_steps=8), seed=1)

    def run_of(name: str) -> trainer.Trainer:
        (tmp_path / name).mkdir()
        return trainer.Trainer(cfg, paths, tmp_path / name, rank)

    straight = run_of("straight")
    stream = straight.data.batches()
    for _ in range(4):
        straight.optimizer_step(stream)
    saved = straight.data.sampler.state_dict()
    assert (saved["epoch"], saved["segments"]) == (1, [[1, 4]])  # one batch of 4 into epoch 1

    resumed = run_of("resumed")
    resumed.data.sampler.load_state_dict(saved)
    after_resume = [b["index"].tolist() for b, _ in zip(resumed.data.batches(), range(6), strict=False)]
    assert after_resume == [next(stream)["index"].tolist() for _ in range(6)]
