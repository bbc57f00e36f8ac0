"""What a checkpoint holds besides the model and the optimizer: the state of every component that
saves and restores itself, assembled in one place (torchtitan's checkpointer takes its
components' ``state_dict`` the same way).

Two kinds of component, each with ``state_dict()`` and ``load_state_dict()``:

- the run's (``Stateful``): one state, the same on every rank, saved once: the learning-rate
  schedule, the grad scaler, the sampler's position, the micro-batcher (``memory.auto_microbatch``);
- each rank's (``RankStateful``): the RNG streams, the counts trained on, the open metrics window.
  Every rank's part is gathered into ``per_rank``; at a resume each component gets every saved
  rank's part and takes its own, or, after a change of world size, what its rule says (the counts
  are split evenly, the window goes to rank 0, the RNG streams start afresh from the seed).

The layout on disk (what older checkpoints hold too; a test writes it by hand and resumes from it)::

    step, schedule, scaler, sampler, micro_batch (null without auto_microbatch; absent before it),
    per_rank: [{rng, samples, units, batches, window}, ...], world_size,
    compat, provenance, optim (records a resume checks against, not state)
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import numpy as np
import torch

from orchestrator.training import resume, runtime
from orchestrator.training.runtime import Runtime

OPTIONAL = frozenset({"micro_batch"})  # a run's component whose key an older checkpoint may lack


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any, /) -> None: ...


class RankStateful(Protocol):
    def state_dict(self) -> dict[str, Any]:
        """This rank's part: its keys go into this rank's entry of ``per_rank``."""

    def load_state_dict(self, ranks: list[dict[str, Any]], /) -> None:
        """Every saved rank's entry of ``per_rank`` (as many as the saving world had ranks)."""


def rng_state() -> dict[str, Any]:
    """Every generator this rank draws from; its CUDA device's too (dropout on a GPU draws there),
    or a resume would not be bit-identical."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if runtime.uses_cuda():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: this rank's own
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and runtime.uses_cuda():  # a CPU resume of a GPU run has no stream to restore
        torch.cuda.set_rng_state(state["cuda"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


class RngState:
    """This rank's random streams. The same world: each rank continues its own. Another world: the
    streams the seed gave at start-up (``runtime.seed_everything``): no old rank is this one."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def state_dict(self) -> dict[str, Any]:
        return {"rng": rng_state()}

    def load_state_dict(self, ranks: list[dict[str, Any]]) -> None:
        if len(ranks) == self.rt.env.world_size:
            set_rng_state(ranks[self.rt.env.rank]["rng"])


class Counters:
    """What this rank trained on since the run's step 0: real samples and the task's units (tokens
    for a language model), kept on the device (no host read per step), and micro-batches read."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.real_samples = torch.zeros((), dtype=torch.int64, device=rt.device)
        self.units = torch.zeros((), dtype=torch.int64, device=rt.device)
        self.batches = 0

    def add(self, sums: torch.Tensor) -> None:
        """A step's [loss sum, unit count, real-sample count] (device ops only)."""
        self.units += sums[1].to(torch.int64)
        self.real_samples += sums[2].to(torch.int64)

    @property
    def samples(self) -> int:
        """Real samples this rank trained on (a host read: checkpoints and the summary only)."""
        return int(self.real_samples)

    def state_dict(self) -> dict[str, Any]:
        return {"samples": self.samples, "units": int(self.units), "batches": self.batches}

    def load_state_dict(self, ranks: list[dict[str, Any]]) -> None:
        """``resume.carried_counts``: this rank's own, or after an elastic resume an even share of
        the old ranks' totals, so ``samples_per_rank`` means one thing whatever the world size."""
        counts = resume.carried_counts(ranks, self.rt.env.world_size, self.rt.env.rank)
        self.real_samples.fill_(counts.samples)
        self.units.fill_(counts.units)
        self.batches = counts.batches


class TrainState:
    """The components a checkpoint saves and restores, by key (the run's) and in order (each rank's).
    A run's component that is None (the micro-batcher when off) is saved as null and not loaded."""

    def __init__(self, rt: Runtime, run: dict[str, Stateful | None], per_rank: list[RankStateful]) -> None:
        self.rt, self.run, self.per_rank = rt, run, per_rank

    def state_dict(self, step: int, records: dict[str, Any]) -> dict[str, Any]:
        """Collective: every rank's part is gathered. ``records``: what a resume checks against."""
        mine: dict[str, Any] = {}
        for component in self.per_rank:
            mine.update(component.state_dict())
        state: dict[str, Any] = {"step": step}
        state.update({key: None if c is None else c.state_dict() for key, c in self.run.items()})
        state.update(per_rank=runtime.gather(self.rt, mine), world_size=self.rt.env.world_size, **records)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, component in self.run.items():
            if component is not None:
                component.load_state_dict(state.get(key) if key in OPTIONAL else state[key])
        for rank_component in self.per_rank:
            rank_component.load_state_dict(state["per_rank"])
