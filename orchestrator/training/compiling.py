"""``model.compile=true``: torch.compile per block, compiled before the first step, the compiled
artifacts kept in the run directory so that a resume or a requeue does not compile again.

- What is compiled (``model.compile_scope=blocks``, the default): the model's fsdp units
  (``fsdp_units()``: the built-in models' blocks), else the classes a Hugging Face model names in
  ``_no_split_modules``, else the whole model; ``model.compile_scope=model``: the whole model, as
  nanoGPT does (one graph: fusion across blocks, and inductor sees the embedding, the head and the
  loss's input; under ddp only: fsdp's per-block hooks need per-block graphs). Each with
  ``module.compile()``, in place: parameter names, state dicts and checkpoints are those of the
  eager model, so either kind of run resumes the other's checkpoint.
- Under ddp, dynamo's DDP optimizer splits each compiled graph where DDP's 25 MB gradient buckets
  end, so a bucket's all-reduce can start while backward goes on; ``model.compile_optimize_ddp=
  false`` turns that off (``torch._dynamo.config.optimize_ddp``): one graph per compiled module,
  more fusion, the all-reduces after backward. On one GPU there is nothing to overlap with.
- The order is torchtitan's: activation checkpointing (``build_model``), compile, then the
  strategy's wrap (DDP or ``fully_shard``): compile is part of the builder the strategy calls.
- When: compile is lazy (the first call of each block), so ``warm_up`` runs one zero-loss forward
  and backward on a real full-size batch right after the model is built (it replaces ddp's
  bucket-settling zero step). Every rank compiles the same graphs at the same time; a collective
  inside the warm-up (ddp's all-reduce, fsdp's all-gathers) waits only for the ranks' difference
  in compile time, not for the compile, and must stay within ``cluster.init_timeout_s`` (the
  timeout before the first step has ended, 600 s by default): raise it when one rank may compile
  much longer than another (a cold cache on one node, a warm one on the other). The phase is
  ``compile`` in ``summary.json``'s ``startup_s`` and in the start-up line. The eval graphs
  compile at the first evaluation.
- Recompiles are counted (torch's ``recompiles`` log is turned on beside the user's
  ``TORCH_LOGS``: each one's failed guard on the rank's stderr); past
  ``model.compile_recompile_limit`` for one block the run fails, naming the last guard.
- The cache: rank 0 publishes, after the warm-up, one file ``RUN/compile_cache/<key>.bin``
  (atomically), ``key`` a hash of the model, compile, memory and data config and the strategy.
  It holds ``torch.compiler.save_cache_artifacts()`` (the graphs: dynamo's, AOTAutograd's,
  inductor's generated code; on a GPU also the built Triton kernels) and, for a CPU, the C++
  kernels inductor built with the compiler, which the artifacts hold only as source: the ``.so``
  of every kernel this process loaded, and every binary that appeared in inductor's code cache
  during the warm-up (its vector ISA probes). Every rank of a later attempt unpacks the kernels
  into inductor's node-local cache (``/tmp/torchinductor_$USER`` unless
  ``TORCHINDUCTOR_CACHE_DIR`` says otherwise: shared by the node's ranks; each file written to a
  temp name and renamed, so ranks unpacking at once never see half a library) and loads the
  artifacts, before the warm-up: inductor then finds its graphs and its kernels, on this node or
  another, instead of generating and building them. A kernel built for another CPU's vector ISA
  has another key and is built again; an ISA probe runs in a subprocess, so one copied to a
  CPU without that ISA fails there. A file from another torch version, one whose checksum does
  not match, or whose kernels do not fit its header, is ignored with a warning. A cache that
  cannot be written (a read-only or full disk) is a warning too: the run, compiled, trains on.
- Rank 0 prints ``compile: N blocks in S s (backend, cache ...)`` after the warm-up: each
  attempt's own figure (the start-up line is printed at the end of a run, which a requeued
  attempt never reaches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn

from durable import atomic
from orchestrator.config import ModelCompileConfig, TrainConfig, check_compile, group_dict
from orchestrator.training import blocks

COMPILE_KEYS = tuple(f.name for f in dataclasses.fields(ModelCompileConfig))
CACHE_DIR = "compile_cache"
MAGIC = b"SWYDCC2\n"  # 2: the built C++ kernels ride along


class RecompileLimitError(RuntimeError):
    """A block was recompiled more often than ``model.compile_recompile_limit``."""


@dataclass(frozen=True)
class CompileSpec:
    enabled: bool = False
    fullgraph: bool = True
    mode: str = "default"
    backend: str = "inductor"
    dynamic: bool | None = None
    recompile_limit: int = 8
    scope: str = "blocks"  # blocks | model
    optimize_ddp: bool = True


def split(kwargs: dict[str, Any]) -> tuple[dict[str, Any], CompileSpec]:
    """A model spec as a dict -> (the constructor's keyword arguments, the compile options)."""
    check_compile(kwargs)
    options = {k: kwargs[k] for k in COMPILE_KEYS if k in kwargs}
    spec = CompileSpec(**{("enabled" if k == "compile" else k.removeprefix("compile_")): v
                          for k, v in options.items()})
    return {k: v for k, v in kwargs.items() if k not in COMPILE_KEYS}, spec


def spec_of(model_spec: Any) -> CompileSpec:
    return split(group_dict(model_spec))[1]


def units(model: nn.Module, class_names: list[str], scope: str = "blocks") -> list[nn.Module]:
    """What is compiled one by one: the blocks fsdp shards (``blocks.choose``), else the whole
    model; ``scope="model"``: the whole model."""
    if scope == "model":
        return [model]
    return blocks.choose(model, class_names)[0] or [model]


def compile_in_place(model: nn.Module, spec: CompileSpec, class_names: list[str]) -> int:
    """Each block's forward compiled (``nn.Module.compile``: the module object and its parameter
    names stay); returns how many were. Sets dynamo's DDP optimizer (process-wide: one model per
    rank) before anything compiles: compiling is lazy, at the warm-up."""
    torch._dynamo.config.optimize_ddp = spec.optimize_ddp
    found = units(model, class_names, spec.scope)
    for unit in found:
        unit.compile(fullgraph=spec.fullgraph, dynamic=spec.dynamic, backend=spec.backend,
                     mode=None if spec.mode == "default" else spec.mode)
    return len(found)


# ------------------------------------------------------------------------------------------------
# Recompiles


class Recompiles(logging.Handler):
    """Counts torch's ``recompiles`` log records and keeps the last one (the guard that failed)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.count, self.last = 0, ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.last = " ".join(record.getMessage().split())


RECOMPILE_LOGS = ("torch._dynamo.guards.__recompiles", "torch._dynamo.guards.__recompiles_verbose")


def log_recompiles() -> None:
    """torch's ``recompiles`` log on, beside whatever the user's ``TORCH_LOGS`` turned on: torch
    writes a recompile's record only when that log is on (``set_logs`` would replace the user's
    choice, and does nothing at all under ``TORCH_LOGS``: a TORCH_LOGS without ``recompiles``
    counted none)."""
    state = torch._logging._internal.log_state
    if state.is_artifact_enabled("recompiles") or state.is_artifact_enabled("recompiles_verbose"):
        return
    state.enable_artifact("recompiles")
    torch._logging._internal.configure_artifact_log(logging.getLogger(RECOMPILE_LOGS[0]))


def watch_recompiles(limit: int) -> Recompiles:
    """From here on every recompile is logged by torch (its reason on the rank's stderr) and
    counted; the ``limit``-th recompile of one function raises in the step (``limit_errors``)."""
    torch._dynamo.config.recompile_limit = limit
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    log_recompiles()
    handler = Recompiles()
    for name in RECOMPILE_LOGS:
        logging.getLogger(name).addHandler(handler)
    return handler


@contextlib.contextmanager
def limit_errors(recompiles: Recompiles | None, limit: int) -> Iterator[None]:
    """torch's bare "recompile limit" failure, told with the guard that failed and the fixes."""
    try:
        yield
    except torch._dynamo.exc.FailOnRecompileLimitHit as e:
        if recompiles is None:
            raise
        raise RecompileLimitError(
            f"model.compile: a block was recompiled past model.compile_recompile_limit={limit} "
            f"({recompiles.count} recompiles in all); the last failed guard: {recompiles.last or '?'}. "
            f"A dimension that varies from batch to batch: model.compile_dynamic=true, or batches of "
            f"fixed shapes (data.seq_len); expected recompiles: raise "
            f"model.compile_recompile_limit") from e


# ------------------------------------------------------------------------------------------------
# The warm-up and the cache


def cache_key(cfg: TrainConfig) -> str:
    """What the compiled graphs depend on besides torch: the model and its compile options, the
    shapes and dtypes (data, memory) and the strategy (fsdp's hooks)."""
    record = {"model": group_dict(cfg.model), "memory": dataclasses.asdict(cfg.memory),
              "data": dataclasses.asdict(cfg.data), "strategy": cfg.parallelism.strategy,
              "world_size": cfg.parallelism.world_size,
              "gpus": bool(cfg.parallelism.gpus_per_node)}
    return hashlib.sha256(json.dumps(record, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(cfg: TrainConfig, run_dir: Path) -> Path:
    return run_dir / CACHE_DIR / f"{cache_key(cfg)}.bin"


# The file: MAGIC, a one-line JSON header (torch version, payload size and checksum, the size of
# torch's artifacts, each kernel's name and size), then the payload: the artifacts, the kernels.
KERNEL_NAME = re.compile(r"[a-z0-9]{2}/[a-z0-9]+(\.[a-z0-9]+)*\.(so|o)")


def binaries(root: Path, pattern: str = "??/*") -> set[str]:
    """The built files (``.so``, ``.o``) in inductor's code cache ``root`` that ``pattern``
    matches, as ``xx/<hash>.so``."""
    return {name for p in root.glob(pattern) if KERNEL_NAME.fullmatch(name := f"{p.parent.name}/{p.name}")}


def _loaded_kernels(root: Path) -> set[str]:
    """The built files of the C++ kernels this process loaded (each C++ code cache's keys:
    inductor puts key ``k``'s files in ``root/k[1:3]/k*``), be they built or found."""
    from torch._inductor import codecache

    keys: set[str] = set()
    classes: list[type] = [codecache.CppCodeCache]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        keys.update(cls.__dict__.get("cache", {}))
    return {name for key in keys for name in binaries(root, f"{key[1:3]}/{key}*")}


def inductor_dir() -> Path:
    """inductor's node-local cache (``TORCHINDUCTOR_CACHE_DIR``, else ``/tmp/torchinductor_$USER``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def kernels_built_since(before: set[str]) -> set[str]:
    """What the cache carries besides torch's artifacts, which hold inductor's C++ source but not
    its build: the binaries of the kernels this process loaded, and every binary that appeared in
    the code cache since ``before`` (the vector ISA probes inductor builds once per code cache,
    then runs in a subprocess: on a node whose CPU lacks the ISA the probe fails there, and a
    kernel built for another ISA has another key, so neither is used where it cannot run)."""
    root = inductor_dir()
    return _loaded_kernels(root) | (binaries(root) - before)


def save_cache(path: Path, kernels: Collection[str] = ()) -> bool:
    """Publish what this process compiled (rank 0): header, checksum, torch's artifacts and the
    built ``kernels`` (names under ``inductor_dir()``); atomic."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return False
    artifacts, _ = saved
    root = inductor_dir()
    blobs = [(name, (root / name).read_bytes()) for name in sorted(kernels) if (root / name).is_file()]
    payload = artifacts + b"".join(blob for _, blob in blobs)
    header = json.dumps({"torch": torch.__version__, "bytes": len(payload),
                         "xxh3": xxhash.xxh3_64_hexdigest(payload), "artifacts": len(artifacts),
                         "kernels": [[name, len(blob)] for name, blob in blobs]}).encode()
    with atomic.atomic_write(path, binary=True) as f:
        f.write(MAGIC + header + b"\n" + payload)
    return True


def _split(header: dict[str, Any], payload: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The payload -> (torch's artifacts, [(kernel name, its bytes)]); a ValueError if the header
    does not describe it exactly or names a file outside the code cache's layout."""
    at = artifacts_end = int(header["artifacts"])
    kernels = []
    for name, size in header["kernels"]:
        if not isinstance(name, str) or not KERNEL_NAME.fullmatch(name):
            raise ValueError(f"a kernel named {name!r}")
        kernels.append((name, payload[at:at + int(size)]))
        at += int(size)
    if at != len(payload):
        raise ValueError("the kernels' sizes do not add up to the file's")
    return payload[:artifacts_end], kernels


def _unpack(kernels: list[tuple[str, bytes]]) -> None:
    """Each kernel into this node's code cache unless there already: written to a temp name and
    renamed, so the node's ranks, unpacking at once, never see a half-written library."""
    root = inductor_dir()
    for name, blob in kernels:
        target = root / name
        if target.exists():
            continue
        with atomic.atomic_write(target, binary=True, durable=False) as f:
            f.write(blob)
            os.fchmod(f.fileno(), 0o755)  # as the compiler leaves a library


def load_cache(path: Path) -> tuple[bool, str | None]:
    """(loaded, warning): a missing file is neither; another torch's or a damaged one is a warning.
    Loaded: torch's artifacts into its caches, the built kernels into ``inductor_dir()``."""
    if not path.is_file():
        return False, None
    try:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not a Switchyard compile cache of this version")
        header_line, _, payload = data[len(MAGIC):].partition(b"\n")
        header = json.loads(header_line)
        if not isinstance(header, dict):  # valid JSON, but no header: null, a list, a number
            raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
    except (OSError, ValueError) as e:
        return False, f"ignored the compile cache {path}: unreadable ({e}); compiling from scratch"
    if header.get("torch") != torch.__version__:
        return False, (f"ignored the compile cache {path}: written by torch {header.get('torch')}, "
                       f"this is torch {torch.__version__}; compiling from scratch")
    if header.get("bytes") != len(payload) or header.get("xxh3") != xxhash.xxh3_64_hexdigest(payload):
        return False, (f"ignored the compile cache {path}: its checksum does not match (damaged); "
                       f"compiling from scratch")
    try:
        artifacts, kernels = _split(header, payload)
        _unpack(kernels)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"ignored the compile cache {path}: unreadable ({e}); compiling from scratch"
    try:
        torch.compiler.load_cache_artifacts(artifacts)
    except Exception as e:  # torch's own format checks: never trust a cache that fails them
        return False, f"ignored the compile cache {path}: torch refused it ({e}); compiling from scratch"
    return True, None


def warm_up(model: nn.Module, forward: Callable[[nn.Module], torch.Tensor], device: torch.device) -> None:
    """One zero-loss forward and backward in train mode, as the step runs it: every block is
    compiled, forward and backward, before the first step. Gradients are zero (and dropped), the
    buffers (BatchNorm's statistics) and the random state are restored, so the first step trains
    exactly as it would have. Under ddp it also settles the gradient buckets
    (``runtime.settle_buckets``' reason), so it replaces that zero step."""
    cpu_rng = torch.get_rng_state()
    device_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    was_training = model.training
    model.train()
    (forward(model).float().sum() * 0.0).backward()
    model.zero_grad(set_to_none=True)
    model.train(was_training)
    with torch.no_grad():
        for buffer, kept in buffers:
            buffer.copy_(kept)
    torch.set_rng_state(cpu_rng)
    if device_rng is not None:
        torch.cuda.set_rng_state(device_rng, device)


@dataclass
class CompileReport:
    """What ``summary.json`` records under ``compile``."""

    backend: str
    mode: str
    units: int
    warm_up_s: float
    cache: str  # loaded | published | none (nothing to save: eager backends) | unpublished
    # (it could not be written: a warning says why)
    recompiles: int = 0
    warnings: list[str] = dataclasses.field(default_factory=list)


def publish(path: Path, kernels: Collection[str]) -> tuple[str, str | None]:
    """``save_cache``, as the report names it (published, or none: nothing to save), and a warning
    when it could not be written (``RUN/compile_cache`` a file, a read-only or full disk). The cache
    only spares a later attempt its compile: the run, compiled now, trains on without it."""
    try:
        return ("published" if save_cache(path, kernels) else "none"), None
    except OSError as e:
        return "unpublished", (f"could not publish the compile cache {path}: {e.strerror or e} "
                               f"({type(e).__name__}); training on, and a resume or requeue of this "
                               f"run compiles again")


def prepare(spec: CompileSpec, compiled_units: int, cfg: TrainConfig, run_dir: Path, is_main: bool,
            warm: Callable[[], None]) -> tuple[CompileReport, Recompiles]:
    """Load the cache if there is one, compile everything (``warm``), publish the cache (rank 0,
    when there was none to load)."""
    started = time.perf_counter()
    path = cache_path(cfg, run_dir)
    loaded, warning = load_cache(path)
    if warning and is_main:
        print(f"warning: {warning}", flush=True)
    recompiles = watch_recompiles(spec.recompile_limit)
    builds = is_main and not loaded and spec.backend == "inductor"  # C++ kernels to carry
    before = binaries(inductor_dir()) if builds else set()
    with limit_errors(recompiles, spec.recompile_limit):
        warm()
    cache = "loaded" if loaded else "none"
    warnings = [warning] if warning else []
    if not loaded and is_main:
        cache, unpublished = publish(path, kernels_built_since(before) if builds else ())
        if unpublished:
            print(f"warning: {unpublished}", flush=True)
            warnings.append(unpublished)
    report = CompileReport(spec.backend, spec.mode, compiled_units,
                           round(time.perf_counter() - started, 3), cache, warnings=warnings)
    if is_main:  # each attempt's own: a requeued one never reaches the start-up line of its end
        print(f"compile: {compiled_units} blocks in {report.warm_up_s:.2f} s "
              f"({spec.backend}, cache {cache})", flush=True)
    return report, recompiles
