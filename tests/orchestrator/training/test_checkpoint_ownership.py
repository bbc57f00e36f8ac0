"""A run writes and prunes only its own checkpoints (``checkpoint.save``, ``sharded_checkpoint.save``):
a checkpoint another run wrote is never replaced, and ``keep_last`` neither counts nor deletes it.
Each checkpoint records the run that wrote it (``provenance.run_dir``). The fsdp format is saved by
two real gloo ranks, which both refuse (neither waits for the other)."""

from __future__ import annotations

import contextlib
import queue
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rank_helpers import rank_processes
from torch import nn

from orchestrator.training import checkpoint, sharded_checkpoint
from orchestrator.training.checkpoint import CheckpointError

RANK_TIMEOUT_S = 120


def state(step: int, run: str | None) -> dict[str, Any]:
    return {"step": step, "w": torch.full((64,), float(step)), "provenance": {"run_dir": run}}


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def test_a_save_never_replaces_or_prunes_another_runs_checkpoints(tmp_path: Path) -> None:
    """The issue: run b, resumed from a's step 10 inside a's checkpoint.dir, replaced a's step 30
    with its own and pruned a's steps 10 and 20 (a's higher step numbers counted as newer, so b's
    own step 20 went at once)."""
    for step in (10, 20, 30, 40):
        checkpoint.save(tmp_path, step, state(step, "/runs/a"), keep_last=4)
    before = contents(tmp_path)
    with pytest.raises(CheckpointError, match=r"refusing to overwrite .*step-000000030\.pt: it was written "
                                              r"by another run \(hydra.run.dir='/runs/a'\).*checkpoint.dir"):
        checkpoint.save(tmp_path, 30, state(30, "/runs/b"), keep_last=2)
    assert contents(tmp_path) == before
    for step in (50, 60, 70):
        checkpoint.save(tmp_path, step, state(step, "/runs/b"), keep_last=2)
    after = contents(tmp_path)
    assert {k: v for k, v in after.items() if k in before} == before  # a's, byte for byte
    assert [s for s, _ in checkpoint.listed(tmp_path)] == [70, 60, 40, 30, 20, 10]  # b kept its last 2


def test_a_run_replaces_its_own_checkpoint_and_sets_aside_one_nobody_can_read(tmp_path: Path) -> None:
    """A stop right after a resume saves the step it resumed at again. A file of a checkpoint's
    name that cannot be read (damaged, or no checkpoint at all) is no one's known: kept, never
    pruned, and renamed out of the way of a save of its step."""
    checkpoint.save(tmp_path, 10, state(10, "/runs/a"), keep_last=2)
    again = checkpoint.save(tmp_path, 10, {**state(10, "/runs/a"), "w": torch.zeros(64)}, keep_last=2)
    assert checkpoint.load_latest(tmp_path).state["w"].sum() == 0  # type: ignore[union-attr]
    damaged = checkpoint.path_for(tmp_path, 5)
    damaged.write_bytes(b"not a checkpoint: the user's own file")
    for step in (20, 30, 40):
        checkpoint.save(tmp_path, step, state(step, "/runs/a"), keep_last=2)
    assert damaged.exists() and not again.exists()
    for _ in range(2):
        checkpoint.save(tmp_path, 5, state(5, "/runs/a"), keep_last=9)
        damaged.write_bytes(b"garbage")
    first, second = tmp_path / "step-000000005.pt.unreadable", tmp_path / "step-000000005.pt.unreadable-2"
    assert first.read_bytes() == b"not a checkpoint: the user's own file"
    assert second.read_bytes() == b"garbage" and checkpoint.checksum_path(second).exists()  # with its own
    assert [s for s, _ in checkpoint.listed(tmp_path)] == [40, 30, 5]


def _sharded_rank(rank: int, store: str, directory: str, out: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        where = Path(directory)
        for step in (10, 20):
            sharded_checkpoint.save(where, step, sharded_checkpoint.tensors(model, optimizer),
                                    {"step": step, "provenance": {"run_dir": "/runs/a"}}, keep_last=2)
        try:
            sharded_checkpoint.save(where, 20, sharded_checkpoint.tensors(model, optimizer),
                                    {"step": 20, "provenance": {"run_dir": "/runs/b"}}, keep_last=1)
            refused = None
        except CheckpointError as e:
            refused = str(e)
        for step in (30, 40):
            sharded_checkpoint.save(where, step, sharded_checkpoint.tensors(model, optimizer),
                                    {"step": step, "provenance": {"run_dir": "/runs/b"}}, keep_last=1)
        out.put((rank, refused))
    finally:
        dist.destroy_process_group()


def test_an_fsdp_save_refuses_on_every_rank_and_prunes_only_its_own(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    ctx = rank_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=_sharded_rank, args=(r, str(tmp_path / "store"), str(directory), out))
             for r in range(2)]
    for p in procs:
        p.start()
    refused: dict[int, str | None] = {}
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while len(refused) < 2:
            assert time.monotonic() < deadline, f"ranks {sorted({0, 1} - set(refused))} hang"
            with contextlib.suppress(queue.Empty):
                rank, message = out.get(timeout=2)
                refused[rank] = message
                continue
            died = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not died, f"a rank died (exit codes {died}): see its traceback above"
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for message in refused.values():
        assert message is not None and "refusing to overwrite" in message and "step-000000020.dcp" in message
    assert [s for s, _ in checkpoint.listed(directory)] == [40, 20, 10]  # b kept 1; a's both stay
    writers = {p.name: checkpoint.writer(checkpoint.recorded_state(p))
               for _, p in checkpoint.listed(directory)}
    assert writers == {"step-000000040.dcp": "/runs/b", "step-000000020.dcp": "/runs/a",
                       "step-000000010.dcp": "/runs/a"}
    assert not list(directory.glob(".*"))  # no partial directory left by the refused save
