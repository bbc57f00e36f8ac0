"""What a resume continues from, and what the resuming run may change: every rule in one place.

**Whose checkpoint.** A checkpoint records the run directory that wrote it (``provenance``). A run
continues its own checkpoints without being asked (a requeue, a rerun with the same
``hydra.run.dir``); another run's only when told so: ``checkpoint.resume_from=PATH``, a checkpoint
(``step-N.pt``, ``step-N.dcp``) or a directory of them (its newest good one). Once this run has
written checkpoints of its own they come first: a requeue continues from them, not again from PATH.
A ``checkpoint.dir`` holding another run's checkpoints is refused, naming both runs, even when
``checkpoint.resume_from`` names one of them: this run's saves would land among the other run's
(a step it saves again would be the other run's file, and ``keep_last`` would weigh its steps
against the other run's). The saving code holds the same rule on its own (``checkpoint.save``):
a run writes and prunes only its own checkpoints.

**What may change.** Per key, decided here and nowhere else:

- refused (``compatibility``): what the checkpoint's weights, data order and random streams were
  made under and a resume cannot follow: the model and the shapes it takes from the data, the task,
  ``optim.name``, fp16's grad scaler, ``parallelism.strategy``, ``seed`` (the data order and every
  rank's random streams continue from the checkpoint), the training data (its fingerprint, not its
  path: a moved dataset resumes), and the samples each rank trains per step (``data.batch_size`` x
  ``optim.grad_accum_steps``). The world size may change (an elastic resume).
- applied: every ``optim.*`` hyperparameter that is not refused (``optim.lr``, ``weight_decay``,
  ``momentum``, ``schedule``, ``warmup_steps``, ``max_steps``, ``clip_grad_norm``, ...). The restored
  optimizer and schedule are given the new values (``apply_optim``): the optimizer's own state
  would otherwise bring the checkpoint's learning rate back. The changes are printed and recorded
  in summary.json (``resumed_from.config_changes``). ``optim.max_steps`` below the checkpoint's
  step is refused.
- followed: ``data.eval_path`` (any eval set), compared with the training data before every
  submission as on the first (``eval_data.check_eval_matches``: tokenizer, classes, fields).
- the code and torch's version: ``provenance.resume_change``, refused unless
  ``checkpoint.allow_code_change=true``.

Checked twice: before submission against the newest checkpoint's recorded state
(``check_before_submit``: nothing of the weights is read), and on the ranks (``Trainer.restore``)
against the checkpoint really loaded.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import torch

from orchestrator.config import ConfigError, OptimConfig, TrainConfig, group_dict
from orchestrator.launch import provenance
from orchestrator.training import checkpoint, compiling
from orchestrator.training.checkpoint import CheckpointError

# What a checkpoint written before a key existed had: a Switchyard without fsdp wrote ddp's. A key
# neither recorded nor listed here is not compared (a checkpoint from before it was recorded).
_COMPAT_BEFORE = {"strategy": "ddp", "task": {"_target_": "orchestrator.training.tasks.classify.Classify"}}

# The config key behind each recorded value, for the refusal; the others are the dataset's shapes.
_KEY_NAMES = {"optimizer": "optim.name", "amp_scaler": "memory.amp=fp16 (its grad scaler)",
              "strategy": "parallelism.strategy", "data": "data.path (the dataset's fingerprint)",
              "samples_per_step": "data.batch_size x optim.grad_accum_steps (samples per rank per step)"}

_REFUSED_OPTIM = ("name", "grad_accum_steps")  # in compatibility; every other optim.* key is applied


def checkpoint_dir(cfg: TrainConfig, run_dir: Path) -> Path:
    """Where this run writes its checkpoints (and finds its own to resume)."""
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"


def compatibility(cfg: TrainConfig, dataset_kwargs: dict[str, Any], data_fingerprint: str) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it (recorded as its ``compat``)."""
    model = compiling.split(group_dict(cfg.model))[0]  # compiled or not: the same weights
    return {"model": model, **dataset_kwargs, "task": group_dict(cfg.task),
            "optimizer": cfg.optim.name, "amp_scaler": cfg.memory.amp == "fp16",
            "strategy": cfg.parallelism.strategy, "seed": cfg.seed, "data": data_fingerprint,
            "samples_per_step": cfg.data.batch_size * cfg.optim.grad_accum_steps}


_RUN_KEYS = ("model", "task", "optimizer", "amp_scaler", "strategy", "seed", "data", "samples_per_step")


def model_of(compat: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the model's config, what it took from the dataset) from a checkpoint's ``compat``: what
    rebuilds the model a checkpoint's weights belong to (``switchyard export``)."""
    return dict(compat["model"]), {k: v for k, v in compat.items() if k not in _RUN_KEYS}


def check_compatible(saved: dict[str, Any], current: dict[str, Any], path: Path) -> None:
    changed = [f"{_KEY_NAMES.get(k, k)}: checkpoint {saved.get(k, _COMPAT_BEFORE.get(k))!r}, now {v!r}"
               for k, v in current.items()
               if (k in saved or k in _COMPAT_BEFORE) and saved.get(k, _COMPAT_BEFORE.get(k)) != v]
    if changed:
        raise CheckpointError(
            f"cannot resume from {path}: the config changed in ways a resume cannot follow:\n  "
            + "\n  ".join(changed) + "\nResume with the checkpoint's values, or start a new run (a new "
            "hydra.run.dir, or checkpoint.dir). A resume applies changes to optim.lr, the schedule, "
            "optim.max_steps and the other optim.* values.")


def check_code(saved: dict[str, Any] | None, path: Path, allow: bool,
               run_dir: str | Path | None = None) -> dict[str, Any] | None:
    """Refuse a resume under other code than the checkpoint was written with (``provenance``;
    with ``run_dir``, its container image too), unless ``checkpoint.allow_code_change``; returns
    the change let through, for summary.json."""
    change = provenance.resume_change(saved, provenance.for_checkpoint(run_dir))
    if change is None or allow:
        return change
    raise CheckpointError(
        f"cannot resume from {path}: it was written under other code: "
        f"{provenance.describe_change(change)}. If the change is intended, add "
        f"checkpoint.allow_code_change=true (the change is then recorded in summary.json); otherwise "
        f"resume under the code it was written with, or use a new run directory")


def check_max_steps(step: int, cfg: OptimConfig, path: Path) -> None:
    if cfg.max_steps < step:
        raise CheckpointError(
            f"cannot resume from {path}: optim.max_steps={cfg.max_steps} is below its step {step}, so "
            f"the run would report {step} steps (try optim.max_steps={step} or more, or a new run)")


def optim_record(cfg: OptimConfig) -> dict[str, Any]:
    """The optimizer's config as a checkpoint records it (``config_changes`` at a resume)."""
    return dataclasses.asdict(cfg)


def config_changes(saved: dict[str, Any] | None, cfg: OptimConfig) -> dict[str, list[Any]]:
    """``{"optim.lr": [checkpoint's, now]}`` for each applied key that changed."""
    now = optim_record(cfg)
    return {f"optim.{k}": [saved[k], v] for k, v in now.items()
            if saved is not None and k in saved and k not in _REFUSED_OPTIM and saved[k] != v}


def apply_optim(optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LambdaLR,
                cfg: OptimConfig, kernels: dict[str, bool] | None = None) -> None:
    """After the optimizer's and the schedule's state are restored: their hyperparameters are this
    run's, not the checkpoint's. The schedule's function is already this run's (a closure is not
    saved), its position the checkpoint's; the learning rate of the next step follows from both.
    ``kernels``: this run's ``fused``/``foreach`` flags (``optim.implementation``), which loading
    the checkpoint's parameter groups would otherwise have replaced with the writer's."""
    schedule.base_lrs = [cfg.lr for _ in optimizer.param_groups]
    for group, factor in zip(optimizer.param_groups, schedule.lr_lambdas, strict=True):
        group.update(kernels or {})
        group["initial_lr"] = cfg.lr
        group["lr"] = cfg.lr * factor(schedule.last_epoch)
        group["weight_decay"] = cfg.weight_decay
        if "momentum" in group:  # sgd
            group["momentum"] = cfg.momentum


class Counts(NamedTuple):
    samples: int
    units: int
    batches: int


def carried_counts(per_rank: list[dict[str, Any]], world_size: int, rank: int) -> Counts:
    """What this rank's counts start from at a resume, so that ``samples_per_rank`` (and the task's
    units, ``batches_per_rank``) mean one thing whatever the world size: since the run's step 0.
    The same world: this rank's own. Another world (an elastic resume): the old ranks' totals split
    evenly over the new ranks (the sums stay the run's totals), and the micro-batches every rank
    read (every rank runs every step)."""
    if len(per_rank) == world_size:
        mine = per_rank[rank]
        return Counts(int(mine["samples"]), int(mine.get("units", mine["samples"])), int(mine["batches"]))

    def share(total: int) -> int:
        return total // world_size + (1 if rank < total % world_size else 0)

    return Counts(share(sum(int(r["samples"]) for r in per_rank)),
                  share(sum(int(r.get("units", r["samples"])) for r in per_rank)),
                  max(int(r["batches"]) for r in per_rank))


# ------------------------------------------------------------------------------------------------
# Which checkpoint


writer = checkpoint.writer  # the run directory that wrote a checkpoint's state


def source(cfg: TrainConfig, run_dir: Path, own: Path | None, own_writer: str | None) -> Path | None:
    """Where this run resumes from: None for its own checkpoint directory (``own``, its newest
    checkpoint, or a fresh start when there is none), else ``checkpoint.resume_from``. Refuses a
    checkpoint directory holding another run's checkpoints."""
    named = Path(cfg.checkpoint.resume_from).expanduser() if cfg.checkpoint.resume_from else None
    this = provenance.run_id(run_dir)
    if own is None:
        return named
    if own_writer is None or own_writer == this:
        return None  # this run's own: a requeue or a rerun continues where it got to
    directory = checkpoint_dir(cfg, run_dir)
    held = (f"checkpoint.dir={str(directory)!r} holds checkpoints of another run (newest: {own.name}, "
            f"written by hydra.run.dir={own_writer!r}), not of this run (hydra.run.dir={this!r})")
    if named is not None:  # even one of that directory's own: this run would save among them
        raise CheckpointError(
            f"{held}: this run's saves would be pruned and resumed among them, and would replace "
            f"that run's checkpoints of the same steps (keep "
            f"checkpoint.resume_from={cfg.checkpoint.resume_from!r} and give this run a checkpoint.dir "
            f"of its own, e.g. leave checkpoint.dir unset for RUN_DIR/checkpoints; or continue that "
            f"run itself with hydra.run.dir={own_writer!r})")
    raise CheckpointError(
        f"{held}: a run resumes another run's checkpoint only when told to (try "
        f"checkpoint.resume_from={str(directory)!r} with a checkpoint.dir of this run's own, e.g. "
        f"checkpoint.dir unset; or a new checkpoint.dir to start afresh)")


class Recorded(NamedTuple):
    path: Path
    state: dict[str, Any]  # the train state: step, compat, provenance, optim (no tensors)


def newest_recorded(where: Path) -> Recorded | None:
    """The newest checkpoint of ``where`` (a directory, or one checkpoint) whose train state reads,
    without its tensors (``mmap``: a multi-GB checkpoint costs its pickled header). Submission
    side: a damaged one is skipped here and reported by the ranks, which verify checksums."""
    for path in checkpoint.candidates(where):
        try:
            return Recorded(path, checkpoint.recorded_state(path))
        except CheckpointError:  # damaged: the ranks skip it with a warning, or fail naming it
            continue
    return None


def check_before_submit(cfg: TrainConfig, run_dir: Path, current: dict[str, Any]) -> None:
    """The resume the ranks would make, refused now if they would refuse it: another run's
    checkpoint directory, a missing ``checkpoint.resume_from``, a refused config change, or
    ``optim.max_steps`` below the checkpoint's step. ``current``: this config's ``compatibility``.
    The code is compared on the ranks, under the snapshot they import."""
    try:
        own = newest_recorded(checkpoint_dir(cfg, run_dir))
        where = source(cfg, run_dir, own.path if own else None, writer(own.state) if own else None)
        found = own if where is None else newest_recorded(where)
        if where is not None and found is None:
            raise CheckpointError(f"checkpoint.resume_from={cfg.checkpoint.resume_from!r} holds no "
                                  f"readable checkpoint (name a step-N.pt or step-N.dcp, or a "
                                  f"checkpoint.dir that holds them)")
        if found is not None:
            check_compatible(found.state.get("compat", {}), current, found.path)
            check_max_steps(int(found.state["step"]), cfg.optim, found.path)
    except CheckpointError as e:
        raise ConfigError(str(e)) from e
