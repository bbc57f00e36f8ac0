"""fsdp checkpoints: every rank writes its own shards (``torch.distributed.checkpoint``); no rank
ever gathers the whole model or optimizer state.

A checkpoint is a directory ``step-N.dcp/``::

    .metadata        DCP's index of every tensor's shards (rank 0 writes it)
    __R_0.distcp     rank R's shards of the model and optimizer state
    train_state.pt   step, schedule, scaler, sampler, per-rank RNG states, compat (rank 0)
    checksums.json   xxh3 of each file above, written last

The rules of single-file checkpoints (``checkpoint``) hold: the directory is written as
``.step-N.dcp.partial`` and renamed only once every rank's files are on disk, fsynced and
checksummed, so a killed save leaves no ``step-N.dcp`` at all; ``keep_last`` prunes both kinds.
Loading verifies every file against ``checksums.json`` first, the files spread over the ranks
(rank r hashes every world-th file), and every rank agrees on the outcome: a checkpoint with a
truncated or changed shard is skipped, with its reason, and the previous one is used.

DCP reshards on load, so a checkpoint written by 4 ranks loads on 2 (or 8).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from durable.atomic import fsync_dir, write_json
from orchestrator.training import checkpoint
from orchestrator.training.checkpoint import CheckpointError, file_checksum

# DCP (torch.distributed.checkpoint) is imported where a sharded checkpoint is written or read, not
# above: it pulls in DTensor and torch._dynamo, a second of CPU that `jobs.train`'s submitting
# process and a ddp run (which only asks ``is_sharded``) would pay for nothing.

SUFFIX = ".dcp"
CHECKSUMS = "checksums.json"
TRAIN_STATE = checkpoint.TRAIN_STATE


def is_sharded(path: Path) -> bool:
    return path.name.endswith(SUFFIX)


def path_for(directory: Path, step: int) -> Path:
    return directory / f"step-{step:09d}{SUFFIX}"


def _partial(final: Path) -> Path:
    return final.with_name(f".{final.name}.partial")


def tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards, keyed by parameter name (DCP matches them by name and offset)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def _gather(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def save(directory: Path, step: int, shards: dict[str, Any], train_state: dict[str, Any],
         keep_last: int, group: dist.ProcessGroup | None = None) -> Path:
    """Every rank calls this (collective over ``group``, the default group when None) with its own
    ``shards`` (``tensors``, or a host copy of them). Rank 0 publishes the directory once it is
    complete, then prunes to ``keep_last`` of this run's own (``checkpoint.prune``); a checkpoint
    of this step that another run wrote is refused on every rank, not replaced, and one that
    cannot be read is set aside (``checkpoint.make_way``). A background save
    passes its own gloo group: its collectives then never interleave with the training's on the
    default group."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    final = path_for(directory, step)
    partial = _partial(final)
    owner = checkpoint.writer(train_state)
    refusal = None
    if rank == 0:
        try:
            checkpoint.make_way(final, owner)
        except CheckpointError as e:
            refusal = str(e)
        else:  # a save killed earlier left its partial directory: nobody else writes here
            for stale in directory.glob(f".step-*{SUFFIX}.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir(parents=True)
    refusal = _gather(refusal, group)[0]  # rank 0's verdict, and the barrier before every rank writes
    if refusal is not None:
        raise CheckpointError(refusal)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(shards, storage_writer=dcp.FileSystemWriter(partial, sync_files=True), process_group=group)
        if rank == 0:
            with open(partial / TRAIN_STATE, "wb") as f:
                torch.save(train_state, f)
                f.flush()
                os.fsync(f.fileno())
    except (OSError, RuntimeError, CheckpointException) as e:  # DCP's: alike on every rank
        failure = checkpoint.save_failed(final, e)  # the free space before the partial frees it
        if failure is None:
            raise
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise failure from e
    dist.barrier(group=group)
    names = sorted(p.name for p in partial.iterdir())
    mine = {name: file_checksum(partial / name) for i, name in enumerate(names) if i % world == rank}
    everyone = _gather(mine, group)  # each rank hashes its share, read back from the page cache
    if rank == 0:
        write_json(partial / CHECKSUMS, {k: v for part in everyone for k, v in sorted(part.items())},
                   indent=1)
        _publish(partial, final)
        checkpoint.remember_writer(final, owner)
        checkpoint.prune(directory, keep_last, owner)
    dist.barrier(group=group)
    return final


def _publish(partial: Path, final: Path) -> None:
    """``partial`` becomes ``final``; an older ``final`` of the same step is replaced only after."""
    fsync_dir(partial)
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    partial.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _problems(path: Path, rank: int, world: int) -> list[str]:
    """What is wrong with this rank's share of ``path``'s files (empty: nothing)."""
    try:
        expected: dict[str, str] = json.loads((path / CHECKSUMS).read_text())
    except (OSError, ValueError) as e:
        return [f"no readable {CHECKSUMS} ({type(e).__name__}): not a complete checkpoint"]
    problems = []
    for i, (name, digest) in enumerate(sorted(expected.items())):
        if i % world != rank:
            continue
        try:
            actual = file_checksum(path / name)
        except OSError as e:
            problems.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if actual != digest:
            problems.append(f"{name}: checksum mismatch (xxh3 {actual}, written as {digest}): the file "
                            f"changed after it was saved")
    return problems


def problems(path: Path) -> list[str]:
    """Every file of ``path`` checked by one process (``switchyard export``): empty when intact."""
    return _problems(path, 0, 1)


def choose(candidates: list[Path]) -> tuple[Path | None, list[str]]:
    """The newest of ``candidates`` (newest first, the same list on every rank) whose every file is
    intact, and why newer ones were skipped. Collective; every rank gets the same answer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    skipped: list[str] = []
    for path in candidates:
        problems = [p for part in _gather(_problems(path, rank, world)) for p in part]
        if not problems:
            return path, skipped
        skipped.append(f"{path.name}: {problems[0][:300]}")
    if skipped:
        raise CheckpointError(f"no readable checkpoint in {candidates[0].parent}: " + "; ".join(skipped))
    return None, skipped


def train_state(path: Path) -> dict[str, Any]:
    """Everything but the tensors (on the CPU): read by every rank."""
    return checkpoint.recorded_state(path)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank reads the pieces of its own shards, whatever world size wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    state = tensors(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=path)
    except Exception as e:  # every rank fails alike: the files passed their checksums
        raise CheckpointError(f"cannot load {path} into this model: {e}") from e
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
