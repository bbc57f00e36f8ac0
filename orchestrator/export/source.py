"""What an export is made from: a run's checkpoint of one step, verified against its checksums,
its model rebuilt from what the checkpoint records and given the checkpoint's weights on the host.

A checkpoint holds everything needed: ``compat`` names the model's config and what it took from
the dataset (``resume.model_of``), ``provenance`` the code snapshot. The run's config adds only
where its checkpoints are (``checkpoint.dir``) and the dataset, whose tokenizer an export ships.

An fsdp checkpoint (``step-N.dcp``) is read on the host by one process without a process group,
in pieces of at most ``PIECE_BYTES`` (DCP reads only the byte ranges of the tensors asked for):
no GPU and no rank ever holds the model; the host holds the model's weights once, plus one piece.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from omegaconf import OmegaConf
from torch import nn

from orchestrator.config import ConfigError, MemoryConfig
from orchestrator.training import checkpoint, resume, sharded_checkpoint
from orchestrator.training.checkpoint import CheckpointError
from orchestrator.training.step import build_model

PIECE_BYTES = 1 << 30
# Where a run records its config: a single job's (RUN/.switchyard/), Hydra's own, `switchyard run`'s.
_CONFIG_FILES = (".switchyard/config.yaml", ".hydra/config.yaml", "config.yaml")


class ExportError(RuntimeError):
    """Bad input to an export: one line naming the value and the fix (exit 2)."""


@dataclass(frozen=True)
class Source:
    run_dir: Path | None  # None: a checkpoint given on its own
    path: Path  # the checkpoint: step-N.pt or step-N.dcp
    step: int
    state: dict[str, Any]  # its train state: step, compat, provenance (no tensors)
    checksum: str  # xxh3 of the checkpoint file, or of an fsdp checkpoint's checksums.json

    @property
    def code_hash(self) -> str | None:
        return (self.state.get("provenance") or {}).get("code_hash")

    @property
    def model_spec(self) -> dict[str, Any]:
        return resume.model_of(self.state["compat"])[0]


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's composed config as plain values (interpolations left as written); {} if none."""
    for name in _CONFIG_FILES:
        path = run_dir / name
        if path.is_file():
            try:
                loaded = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except Exception:  # a damaged file: the checkpoint alone still exports
                continue
            return {str(k): v for k, v in loaded.items()} if isinstance(loaded, dict) else {}
    return {}


def checkpoint_dir(run_dir: Path) -> Path:
    named = (run_config(run_dir).get("checkpoint") or {}).get("dir")
    return Path(str(named)).expanduser() if named and "${" not in str(named) else run_dir / "checkpoints"


def find(run_dir: Path, step: int | None) -> Path:
    """The checkpoint of ``step`` (the newest when None) of the run in ``run_dir``."""
    if not run_dir.is_dir():
        raise ExportError(f"RUN={str(run_dir)!r} is not a directory: name a run directory (printed "
                          f"as run_dir: at start) or a registry id such as 3/0")
    directory = checkpoint_dir(run_dir)
    found = checkpoint.listed(directory)
    if not found:
        raise ExportError(f"RUN={str(run_dir)!r} has no checkpoint in {directory}: train it with "
                          f"checkpoint.every_steps=N (or to its end), or name the run that wrote them")
    if step is None:
        return found[0][1]
    for number, path in found:
        if number == step:
            return path
    steps = ", ".join(str(n) for n, _ in sorted(found))
    raise ExportError(f"--step {step}: {directory} has no checkpoint of step {step} (it has step"
                      f"{'s' if len(found) > 1 else ''} {steps}; try --step {found[0][0]})")


def open_source(path: Path, run_dir: Path | None) -> Source:
    """The checkpoint at ``path``, its files checked against their checksums first."""
    try:
        if sharded_checkpoint.is_sharded(path):
            problems = sharded_checkpoint.problems(path)
            if problems:
                raise CheckpointError(problems[0])
            digest = xxhash.xxh3_64((path / sharded_checkpoint.CHECKSUMS).read_bytes()).hexdigest()
        else:
            digest = (checkpoint.checksum_path(path).read_text().strip() if checkpoint.verify(path)
                      else checkpoint.file_checksum(path))
        state = checkpoint.recorded_state(path)
    except (CheckpointError, OSError) as e:
        raise ExportError(f"checkpoint {path} cannot be exported: {e} (export another step with "
                          f"--step)") from e
    if "compat" not in state:
        raise ExportError(f"checkpoint {path} records no model config (written by a Switchyard before "
                          f"resumes were checked): it cannot be rebuilt for export")
    return Source(run_dir, path, int(state["step"]), state, digest)


def weights(source: Source) -> dict[str, torch.Tensor]:
    """The model's full state dict on the host (``PIECE_BYTES`` at a time from a DCP directory)."""
    if not sharded_checkpoint.is_sharded(source.path):
        state = torch.load(source.path, map_location="cpu", weights_only=False, mmap=True)
        return dict(state["model"])
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(source.path)).read_metadata()
    shapes = {key.removeprefix("model."): item for key, item in metadata.state_dict_metadata.items()
              if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    out: dict[str, torch.Tensor] = {}
    piece: dict[str, torch.Tensor] = {}
    for name, item in shapes.items():
        piece[name] = torch.empty(item.size, dtype=item.properties.dtype)
        if sum(t.numel() * t.element_size() for t in piece.values()) >= PIECE_BYTES:
            out |= _read(source.path, piece)
            piece = {}
    return out | (_read(source.path, piece) if piece else {})


def _read(path: Path, piece: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"model": piece}, checkpoint_id=str(path), no_dist=True)  # fills the tensors in place
    return piece


def build(source: Source) -> nn.Module:
    """The checkpoint's model, built from its recorded config, with its weights, in eval mode."""
    snapshot = (source.state.get("provenance") or {}).get("snapshot")
    if snapshot and Path(snapshot).is_dir() and snapshot not in sys.path:
        sys.path.insert(0, snapshot)  # the code the run imported, for a model of the user's own
    spec, dataset_kwargs = resume.model_of(source.state["compat"])
    try:
        with torch.device("cpu"):
            model = build_model(spec, dataset_kwargs, MemoryConfig())
    except ConfigError as e:
        raise ExportError(f"cannot rebuild the model of {source.path}: {e}") from e
    try:
        model.load_state_dict(weights(source))
    except RuntimeError as e:
        raise ExportError(f"the weights of {source.path} do not fit model._target_="
                          f"{spec.get('_target_')!r} as built now: {str(e).splitlines()[0]} (export "
                          f"under the code the run used)") from e
    return model.eval()
