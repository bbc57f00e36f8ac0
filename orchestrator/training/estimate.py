"""Will it fit? The peak memory per rank of one training step, estimated before submission.

One real training step (forward, backward, optimizer step) runs on fake tensors
(``FakeTensorMode``: shapes and dtypes, no storage, no arithmetic) under torch's own memory
trackers (``torch.distributed._tools``: ``MemTracker``, and ``FSDPMemTracker`` under fsdp, which
shards the model over a fake process group of ``parallelism.world_size`` ranks exactly as the
ranks will). The model is built from the config as the trainer builds it; the batch is the largest
the loader can produce: ``data.batch_size`` copies of the first sample, every padded field at its
longest (the manifest's ``max_leading``; a language model's windows are always ``data.seq_len``).
Two steps run: the first creates the optimizer state, the second is the steady step whose
backward holds parameters, optimizer state, gradients and activations at once. With
``optim.grad_accum_steps`` above 1 each step runs two micro-batches: the second's backward adds
its gradients to the first's, the most an accumulating step ever holds.

What the trackers cannot see is added here: DDP's gradient buckets (``gradient_as_bucket_view``
is off, so the reducer keeps one more copy of the gradients for the whole run). On a GPU target
the optimizer runs with ``foreach=True``, as torch chooses on CUDA, so its temporaries count.

The GPU's size (``gpu_capacity``): ``cluster.gpu_mem_gb``; on ``cluster=local`` NVML on this
machine; on ``cluster=slurm`` the GPU type the job asks for (``--gres=gpu:h100:4`` in
``cluster.sbatch_args``, a ``cluster.constraint``, or the partition's GRES), from ``GPU_GIB``.
A CPU run is held against the machine's memory per rank.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch._subclasses import FakeTensorMode
    from torch.distributed.device_mesh import DeviceMesh

# torch's fake tensors, memory trackers, fake process group and FSDP are imported where the
# estimate runs, not here: they pull in torch._dynamo, torch._inductor and DTensor (about a second
# of CPU), which a `jobs.train` with memory.estimate=off, and every rank, would pay for nothing.

from durable import atomic
from orchestrator.config import ClusterConfig, ConfigError, TrainConfig
from orchestrator.telemetry import nvml
from orchestrator.training import estimate_memo, runtime, step, strategy
from orchestrator.training.tasks import Batch, Task
from sharding import ShardedDataset

GIB = 1 << 30
# On a GPU a step holds more than its fake trace on CPU shows: the CUDA kernels' own buffers and
# workspaces (cuBLAS, the attention kernels' masks). Measured on an H100 80GB (driver 580.159, torch
# 2.11, 2026-11-26; bench/gpu_check.py's memory rows, a transformer 1024 wide, 8 layers, batch 64 of
# 512 rows): the trace alone was 4 to 11 % under max_memory_allocated at every memory option (none,
# bf16, fp16, activation checkpointing, both, grad accumulation), by 0.2 to 1.07 GiB. This share of
# the traced peak is added on GPU targets, so that no estimate is under a measured peak.
GPU_MARGIN = 0.15
FIT_FRACTION = 0.95  # above this share of the GPU a step is refused: the allocator needs headroom
ESTIMATE_FILE = "memory-estimate.json"  # RUN/: written before submission, read into summary.json

# GiB of the common data-centre GPUs, by the names SLURM sites give them in GRES and features,
# and whether they compute in bf16 (compute capability 8.0 and later: A100 on; a V100 or T4 has
# none). Where a name has two sizes the smaller is assumed (the refusal says so): a wrong "fits"
# costs a queue wait and an OOM, a wrong "does not fit" costs one override.
GPU_GIB: tuple[tuple[str, str, float, bool], ...] = (  # (pattern, name, GiB, bf16), first match wins
    (r"a100.?(80|sxm4.?80)", "A100 80GB", 80, True), (r"a100", "A100 (40 or 80 GiB: 40 assumed)", 40, True),
    (r"h200", "H200", 141, True), (r"h100", "H100", 80, True), (r"l40s?", "L40S", 48, True),
    (r"v100.?32", "V100 32GB", 32, False), (r"v100", "V100 (16 or 32 GiB: 16 assumed)", 16, False),
    (r"(?<![a-z0-9])t4(?![0-9])", "T4", 16, False), (r"p100", "P100 (12 or 16 GiB: 12 assumed)", 12, False),
)


class EstimateUnavailable(RuntimeError):
    """The step cannot run on fake tensors (a model that reads a value on the host, an op with
    no fake kernel, a process group already running here): the submission goes on unestimated.
    ``lasting``: a property of the step, remembered with it (not so a process group that runs
    here now)."""

    def __init__(self, why: str, lasting: bool = False) -> None:
        super().__init__(why)
        self.lasting = lasting


@dataclass(frozen=True)
class Estimate:
    """Bytes per rank at the step's peak, by category (what was live at that moment)."""

    parameters: int  # parameters and buffers; under fsdp the shards plus the gathered units
    gradients: int  # under ddp with its buckets; under fsdp the shards plus unsharded ones
    optimizer: int  # AdamW: 2 fp32 states per parameter, SGD with momentum: 1
    activations: int  # saved for backward, and the input batch
    temporary: int  # backward's transient tensors: gradients of activations, workspaces
    peak: int  # the sum: the most allocated at once
    gpu_margin: int = 0  # GPU targets: what CUDA's kernels hold beyond the fake trace (GPU_MARGIN)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Capacity:
    """The memory one rank has: a GPU's, or the host's share per rank on CPU."""

    bytes: int
    name: str  # "H100", "cluster.gpu_mem_gb", "GPU 0 of this machine", "host memory per rank"
    is_gpu: bool
    has_bf16: bool = True  # False: a V100 or T4 (memory.amp=bf16 is refused; fp16 is suggested)


@dataclass(frozen=True)
class MemoryReport:
    """What the submission shows and ``summary.json`` keeps: the estimate and what it is held to."""

    estimate: Estimate | None
    capacity: Capacity | None
    unavailable: str | None = None  # why there is no estimate
    remembered: bool = False  # read back from memory.estimate_cache, not run in this submission

    @property
    def fraction(self) -> float | None:
        if self.estimate is None or self.capacity is None or self.capacity.bytes <= 0:
            return None
        return self.estimate.peak / self.capacity.bytes

    def line(self) -> str:
        """One line for every submission: ``memory: 21.3 GiB peak per rank of 80 GiB on H100 (estimate)``."""
        if self.estimate is None:
            return f"memory: not estimated ({self.unavailable})"
        peak = f"memory: {gib(self.estimate.peak)} peak per rank"
        kind = "estimate, remembered" if self.remembered else "estimate"
        if self.capacity is None:
            return f"{peak} ({kind}; GPU size unknown: set cluster.gpu_mem_gb to check it)"
        where = f"on {self.capacity.name}" if self.capacity.is_gpu else self.capacity.name
        return f"{peak} of {gib(self.capacity.bytes)} {where} ({kind})"

    def table(self) -> str:
        """The dry run's breakdown: one row per category, then the peak and its share."""
        if self.estimate is None:
            return self.line()
        rows = [(name.replace("_", " "), value) for name, value in self.estimate.as_dict().items()
                if name != "peak" and (name != "gpu_margin" or value)]
        lines = ["| memory per rank (estimate) | size |", "|---|---:|"]
        lines += [f"| {name} | {gib(value)} |" for name, value in rows]
        lines.append(f"| peak | {gib(self.estimate.peak)} |")
        if self.capacity is not None and self.fraction is not None:
            lines.append(f"| share of {gib(self.capacity.bytes)} on {self.capacity.name} | "
                         f"{self.fraction:.0%} |")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"estimate_bytes": self.estimate.as_dict() if self.estimate else None,
                "capacity_bytes": self.capacity.bytes if self.capacity else None,
                "capacity_name": self.capacity.name if self.capacity else None,
                "on_gpu": self.capacity.is_gpu if self.capacity else None,
                "fraction": self.fraction, "unavailable": self.unavailable, "remembered": self.remembered}


def gib(num_bytes: int | float) -> str:
    """``21.3 GiB``; below 1 GiB in MiB (a small model's estimate is not "0.0 GiB")."""
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB else f"{num_bytes / (1 << 20):.1f} MiB"


# ------------------------------------------------------------------------------------------------
# The largest batch


def largest_batch(example: Batch, ds: ShardedDataset, batch_size: int) -> Batch:
    """``example`` (one sample, as the loader builds it) as ``batch_size`` rows of the longest
    shape: each padded field (one with a ``<name>_mask``) padded to the dataset's ``max_leading``,
    its mask all true, its ``_lengths`` the maximum. Each is an expanded view of the one sample
    (no memory of its own): the estimate makes the task's fields whole as fake tensors, so a
    batch larger than this host's memory is estimated, not allocated."""
    out: Batch = {}
    for key, value in example.items():
        stats = ds.field_stats.get(key)
        if f"{key}_mask" in example and stats is not None and value.dim() >= 2:
            value = pad_rows(value, stats.max_leading)  # [1, max_len, ...]
        elif key.endswith("_mask") and key.removesuffix("_mask") in ds.field_stats:
            value = torch.ones(1, ds.field_stats[key.removesuffix("_mask")].max_leading, dtype=value.dtype)
        elif key.endswith("_lengths") and key.removesuffix("_lengths") in ds.field_stats:
            value = torch.full_like(value, ds.field_stats[key.removesuffix("_lengths")].max_leading)
        out[key] = value.expand(batch_size, *value.shape[1:])  # [batch_size, ...]: a view, no copy
    return out


def pad_rows(value: torch.Tensor, length: int) -> torch.Tensor:
    """[1, rows, ...] -> [1, length, ...], zero rows appended."""
    if value.shape[1] >= length:
        return value
    pad = value.new_zeros(value.shape[0], length - value.shape[1], *value.shape[2:])
    return torch.cat([value, pad], dim=1)


# ------------------------------------------------------------------------------------------------
# The step on fake tensors


# Estimates by what they depend on (``memo_key``): a sweep's points are checked in one process
# and mostly differ in keys such as optim.lr, so each distinct step runs once (3-5 s for a large one).
# Each is the estimate, or why the step cannot be estimated, and whether it was read back from
# memory.estimate_cache (estimate_memo: across submissions) instead of run here.
_ESTIMATES: dict[str, tuple[Estimate | str, bool]] = {}


def memo_key(cfg: TrainConfig, ds: ShardedDataset) -> str:
    """Everything the step's memory depends on: not the learning rate, seed, cluster or logging,
    nor where the data lies: the dataset is its fingerprint (schema, shard counts, every file's
    checksum), so two copies of the same data, or the same demo data in two caches, are one step."""
    optim = (cfg.optim.name, cfg.optim.momentum, cfg.optim.grad_accum_steps)  # SGD momentum 0: no state
    data = dataclasses.replace(cfg.data, path=None, eval_path=None, cache_dir="-", num_workers=0)
    return repr((cfg.model, cfg.task, data, cfg.parallelism, cfg.memory.amp,
                 cfg.memory.activation_checkpointing, optim, ds.fingerprint))


def estimate_step(cfg: TrainConfig, task: Task, ds: ShardedDataset, example: Batch) -> Estimate:
    """The peak per rank of one steady training step of ``cfg`` (see the module's docstring),
    remembered for this process and in ``memory.estimate_cache``. Raises EstimateUnavailable when
    the step cannot run on fake tensors."""
    return recalled_step(cfg, task, ds, example)[0]


def recalled_step(cfg: TrainConfig, task: Task, ds: ShardedDataset, example: Batch
                  ) -> tuple[Estimate, bool]:
    """``estimate_step`` and whether its estimate was read back from ``memory.estimate_cache``."""
    key = memo_key(cfg, ds)
    if key not in _ESTIMATES:
        _ESTIMATES[key] = recall_or_run(cfg, key, lambda: run_estimate(cfg, task, ds, example))
    found, remembered = _ESTIMATES[key]
    if isinstance(found, str):
        raise EstimateUnavailable(found, lasting=True)
    return found, remembered


def recall_or_run(cfg: TrainConfig, key: str, run: Callable[[], Estimate]) -> tuple[Estimate | str, bool]:
    """The estimate (or why there is none) from ``memory.estimate_cache``; else ``run()``'s,
    written there. A situational EstimateUnavailable (a process group running here) propagates,
    remembered nowhere."""
    folder = Path(cfg.memory.estimate_cache).expanduser() if cfg.memory.estimate_cache else None
    name = estimate_memo.file_name(key) if folder is not None else ""
    found = estimate_memo.recall(folder, name) if folder is not None else None
    if found is not None:
        if "unavailable" in found:
            return str(found["unavailable"]), True
        try:
            return Estimate(**found["estimate"]), True
        except TypeError:
            pass  # another shape of record under the same format: run it again
    try:
        fresh: Estimate | str = run()
    except EstimateUnavailable as e:
        if not e.lasting:
            raise
        fresh = str(e)
    if folder is not None:
        record = {"unavailable": fresh} if isinstance(fresh, str) else {"estimate": fresh.as_dict()}
        estimate_memo.remember(folder, name, key, record)
    return fresh, False


def run_estimate(cfg: TrainConfig, task: Task, ds: ShardedDataset, example: Batch) -> Estimate:
    batch = largest_batch(example, ds, cfg.data.batch_size)
    kwargs = task.model_kwargs(ds)
    fsdp = cfg.parallelism.strategy == "fsdp"
    from torch._subclasses import FakeTensorMode

    try:
        with fake_world(cfg.parallelism.world_size if fsdp else 0) as mesh, FakeTensorMode() as mode:
            fake = {k: mode.from_tensor(v).contiguous() if k in task.fields() else v  # whole, fake
                    for k, v in batch.items()}
            model = step.build_model(cfg.model, kwargs, cfg.memory)
            fake_weights(model, mode)
            if mesh is not None:
                shard(model, cfg, mesh)
            optimizer = step.build_optimizer(model.parameters(), cfg.optim)
            for group in optimizer.param_groups:  # as torch picks on CUDA: its temporaries count
                group["foreach"] = cfg.parallelism.gpus_per_node > 0
            snapshot = tracked_steps(cfg, task, model, optimizer, fake, fsdp)
    except (ConfigError, EstimateUnavailable):
        raise
    except Exception as e:  # any model's code and torch's fake kernels run here;
        # check_model already ran this model once, so a failure here only costs the estimate
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EstimateUnavailable(f"the step does not run on fake tensors: {type(e).__name__}: "
                                  f"{first[:200]}", lasting=True) from e
    buckets = 0 if fsdp else state_bytes(cfg, kwargs)  # DDP's reducer: one more gradient copy
    return categorise(snapshot, buckets, on_gpu=cfg.parallelism.gpus_per_node > 0)


def fake_weights(model: nn.Module, mode: FakeTensorMode) -> None:
    """Every parameter and buffer the factory made real, made fake of the same shape and dtype: a
    factory that loads weights (``from_pretrained``) builds its structure, then assigns the
    tensors it read from disk, which fake mode does not intercept, and the first operator mixing
    them with the fake batch failed ("Please convert all Tensors to FakeTensors first"). A tensor
    shared by two modules (tied embeddings) stays one tensor, counted once."""
    from torch._subclasses.fake_tensor import FakeTensor

    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        both: tuple[tuple[dict[str, Any], bool], ...] = ((module._parameters, True), (module._buffers, False))
        for slots, is_param in both:
            for name, tensor in slots.items():
                if tensor is None or isinstance(tensor, FakeTensor):
                    continue
                if id(tensor) not in made:
                    fake = mode.from_tensor(tensor)
                    made[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) \
                        if is_param else fake
                slots[name] = made[id(tensor)]


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[DeviceMesh | None]:
    """fsdp (``world_size`` > 0): a fake process group of ``world_size`` ranks in which this
    process is rank 0 (the largest shard), and its mesh; torch's fake backend moves no data."""
    if world_size <= 0:
        yield None
        return
    if dist.is_initialized():
        raise EstimateUnavailable("a process group already runs here, in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore  # with torch's "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))  # outside fake mode: the mesh reads its ranks
    finally:
        dist.destroy_process_group()


def shard(model: nn.Module, cfg: TrainConfig, mesh: DeviceMesh) -> None:
    """As ``strategy.Fsdp.wrap`` (``strategy.shard``): each unit, then the root, with the run's
    mixed precision and resharding."""
    strategy.shard(model, mesh, cfg.parallelism, cfg.memory)


def tracked_steps(cfg: TrainConfig, task: Task, model: nn.Module, optimizer: torch.optim.Optimizer,
                  batch: Batch, fsdp: bool) -> dict[str, int]:
    """Two optimizer steps under the tracker -> its peak snapshot, bytes by category name."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker: MemTracker
    if fsdp:
        tracker = FSDPMemTracker(model, optimizer)
        tracker.track_inputs(tuple(batch.values()))
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer, *batch.values())
    global_peak_only(tracker)
    micro_batches = min(cfg.optim.grad_accum_steps, 2)
    denominator = task.denominator(cfg.data.batch_size) * cfg.optim.grad_accum_steps
    amp = strategy.autocast_amp(cfg.parallelism, cfg.memory)
    model.train()
    with tracker:
        for _ in range(2):  # the first step creates the optimizer state
            for _ in range(micro_batches):
                tracker.reset_mod_stats()  # the tracker refuses a module called twice otherwise
                loss, _, _ = step.batch_loss(model, batch, task, amp, denominator)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    peak: dict[str, int] = {}
    for device_snapshot in tracker.get_tracker_snapshot("peak").values():
        for key, value in device_snapshot.items():
            name = getattr(key, "name", str(key))
            peak[name] = peak.get(name, 0) + int(value)
    return peak


def global_peak_only(tracker: Any) -> None:
    """The estimate reads the tracker's peak over the whole step alone. On every operator torch's
    ``_update_peak_stats`` also walks every module the tracker has seen, to keep each one's own
    peak: a quarter of the estimate's CPU on a 1024-wide, 8-layer transformer, every module visited
    about 10,000 times. This keeps the global peak and its snapshot exactly as torch does, and
    leaves a tracker whose private attributes differ (another torch) as it is."""
    from torch.distributed._tools import mem_tracker

    total = getattr(mem_tracker, "_TOTAL_KEY", None)
    if total is None or not all(hasattr(tracker, name) for name in
                                ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap", "_update_peak_stats")):
        return

    def update_peak(peak_state: Any) -> None:
        for device, snapshot in tracker._curr_mem_snap.items():
            if tracker._peak_mem.get(device, 0) < snapshot[total]:
                tracker._peak_mem[device] = snapshot[total]
                tracker._peak_mem_snap[device] = copy.deepcopy(snapshot)

    tracker._update_peak_stats = update_peak


# the trackers' categories (MemTracker's and FSDPMemTracker's enum names) -> the report's
CATEGORIES = {
    "parameters": ("PARAM", "BUFFER", "SHARDED_PARAM", "UNSHARDED_PARAM", "ALL_GATHER"),
    "gradients": ("GRAD", "SHARDED_GRAD", "UNSHARDED_GRAD", "REDUCE_SCATTER"),
    "optimizer": ("OPT",),
    "activations": ("ACT", "INP", "OTH"),
    "temporary": ("TEMP",),
}


def categorise(snapshot: dict[str, int], buckets: int, on_gpu: bool = False) -> Estimate:
    sums = {category: sum(snapshot.get(name, 0) for name in names)
            for category, names in CATEGORIES.items()}
    sums["gradients"] += buckets
    traced = sum(sums.values())
    margin = int(GPU_MARGIN * traced) if on_gpu else 0
    return Estimate(**sums, peak=traced + margin, gpu_margin=margin)


def state_bytes(cfg: TrainConfig, kwargs: dict[str, Any]) -> int:
    """Bytes of the model's trainable parameters (built on the meta device: nothing allocated)."""
    model = step.build_model_on_meta(cfg.model, kwargs, cfg.memory)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


# ------------------------------------------------------------------------------------------------
# What one rank has


def gpu_capacity(cfg: TrainConfig) -> Capacity | None:
    """The memory of the GPU each rank gets, or of the host per rank on CPU; None: unknown."""
    cluster, parallelism = cfg.cluster, cfg.parallelism
    if parallelism.gpus_per_node == 0:
        total = cluster.mem_gb * GIB if cluster.mode == "slurm" and cluster.mem_gb else \
            psutil.virtual_memory().total
        return Capacity(int(total / parallelism.procs_per_node), "host memory per rank", is_gpu=False)
    known = named_gpu(cfg)
    if cluster.gpu_mem_gb is not None:  # the size given; bf16 or not is still the GPU's own
        return Capacity(int(cluster.gpu_mem_gb * GIB), f"cluster.gpu_mem_gb={cluster.gpu_mem_gb:g}", True,
                        has_bf16=known is None or known.has_bf16)
    return known


def named_gpu(cfg: TrainConfig) -> Capacity | None:
    """The GPU the ranks get, as far as it is known here: NVML on this machine (``cluster=local``,
    ``debug``), the type a SLURM job asks for; None: unknown."""
    if cfg.cluster.mode != "slurm":
        return local_gpu(cfg.parallelism.gpus_per_node)
    return requested_gpu(cfg.cluster)


def requested_gpu(cluster: ClusterConfig) -> Capacity | None:
    """The GPU a SLURM job asks for: a type in ``cluster.sbatch_args`` (``--gres=gpu:h100:4``), a
    ``cluster.constraint``, or the partition's GRES, asked of SLURM only when the job's own
    arguments name no GPU (``sinfo`` waits up to its timeout when the controller is down)."""
    return first_gpu([*cluster.sbatch_args, cluster.constraint or ""]) or \
        first_gpu(partition_gres(cluster.partition))


def first_gpu(texts: list[str]) -> Capacity | None:
    """The first known GPU any of ``texts`` names (``gpu_by_name``); None: none named."""
    return next((known for known in map(gpu_by_name, texts) if known is not None), None)


def gpu_by_name(text: str) -> Capacity | None:
    """The first known GPU named in ``text`` (a GRES like ``gpu:h100:4``, a feature)."""
    for pattern, name, size_gib, has_bf16 in GPU_GIB:
        if re.search(pattern, text.lower()):
            return Capacity(int(size_gib * GIB), name, is_gpu=True, has_bf16=has_bf16)
    return None


def partition_gres(partition: str | None) -> list[str]:
    """The GRES of the partition's nodes (``sinfo -o %G``): the GPUs the job will get."""
    argv = ["sinfo", "-h", "-o", "%G", *(["-p", partition] if partition else [])]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({line.strip() for line in out.splitlines() if "gpu" in line})


def local_gpu(count: int, api: nvml.NvmlApi | nvml.NvmlChoice | None = "auto",
              environ: Mapping[str, str] = os.environ) -> Capacity | None:
    """The smallest of the first ``count`` GPUs this process sees, through NVML (``api``: tests
    inject a scripted one); without bf16 if any of them has none, named after that one."""
    api = nvml.resolve_nvml(api)
    if api is None:
        return None
    try:
        indices = [i for i in nvml.visible_gpus(api, environ)[:count] if i is not None]
        handles = [api.nvmlDeviceGetHandleByIndex(i) for i in indices]
        sizes = [int(api.nvmlDeviceGetMemoryInfo(h).total) for h in handles]
        bf16 = [tuple(api.nvmlDeviceGetCudaComputeCapability(h)) >= runtime.BF16_CAPABILITY for h in handles]
        if not sizes:
            return None
        at = bf16.index(False) if not all(bf16) else sizes.index(min(sizes))
        name = api.nvmlDeviceGetName(handles[at])
    except nvml.NVML_ERRORS:
        return None
    name = name.decode() if isinstance(name, bytes) else name
    return Capacity(min(sizes), f"GPU {indices[at]} of this machine ({name})", True, has_bf16=all(bf16))


def check_bf16(cfg: TrainConfig) -> None:
    """``memory.amp=bf16`` on a GPU known to have no bf16 (compute capability below 8.0: a V100,
    a T4) is refused before submission: such a GPU emulates it at a fraction of fp16's speed, or
    the kernels refuse it. Unknown GPUs (a SLURM job naming no GPU type) pass."""
    if cfg.memory.amp != "bf16" or cfg.parallelism.gpus_per_node == 0:
        return
    gpu = named_gpu(cfg)
    if gpu is not None and not gpu.has_bf16:
        raise ConfigError(runtime.bf16_refusal(gpu.name))


# ------------------------------------------------------------------------------------------------
# The check before submission


Estimator = Callable[[TrainConfig], Estimate]


def check_memory(cfg: TrainConfig, task: Task, ds: ShardedDataset, example: Batch) -> MemoryReport | None:
    """``memory.estimate``: check (refuse a GPU step above ``FIT_FRACTION``, naming the cheapest
    option that fits, and a CPU step above all of the host's memory per rank, where the estimate is
    rougher), warn (report only), off (nothing). None when off."""
    if cfg.memory.estimate == "off":
        return None
    capacity = gpu_capacity(cfg)
    try:
        found, remembered = recalled_step(cfg, task, ds, example)
    except EstimateUnavailable as e:
        return MemoryReport(None, capacity, str(e))
    report = MemoryReport(found, capacity, remembered=remembered)
    fraction = report.fraction
    if cfg.memory.estimate != "check" or capacity is None or fraction is None or found.peak <= 0:
        return report
    if capacity.is_gpu and fraction > FIT_FRACTION:
        def estimator(option: TrainConfig) -> Estimate:
            return estimate_step(option, task, ds, example)
        raise ConfigError(refusal(cfg, report, capacity, estimator))
    if not capacity.is_gpu and fraction > 1.0:  # a CPU run: only a step above all of it is refused
        raise ConfigError(f"memory: the estimated peak is {gib(found.peak)} per rank, more than the "
                          f"{gib(capacity.bytes)} of {capacity.name}: the first step would run out of "
                          f"memory, so nothing was queued (try a data.batch_size below "
                          f"{cfg.data.batch_size} or a smaller model, or memory.estimate=warn to submit "
                          f"anyway)")
    return report


def refusal(cfg: TrainConfig, report: MemoryReport, capacity: Capacity, estimator: Estimator) -> str:
    peak = report.estimate.peak if report.estimate else 0
    head = (f"memory: the estimated peak is {gib(peak)} per rank, above {FIT_FRACTION:.0%} of the "
            f"{gib(capacity.bytes)} of {capacity.name}: the first step would run out of memory, so "
            f"nothing was queued")
    fit = cheapest_fit(cfg, capacity, estimator)
    if fit is None:
        return (f"{head}; no option tried fits (memory.amp=bf16, activation checkpointing, gradient "
                f"accumulation, fsdp on up to 8 times the nodes, and all of them together) (try a "
                f"smaller model or data.batch_size, a larger GPU, or memory.estimate=warn to submit "
                f"anyway)")
    overrides, found = fit
    return (f"{head}; the cheapest option that fits: {' '.join(overrides)}, estimated at "
            f"{gib(found.peak)} ({found.peak / capacity.bytes:.0%}) (try {' '.join(overrides)}, or "
            f"memory.estimate=warn to submit anyway)")


def cheapest_fit(cfg: TrainConfig, capacity: Capacity, estimator: Estimator
                 ) -> tuple[list[str], Estimate] | None:
    """The first of ``options(cfg)`` whose own estimate fits, with it; None if none does."""
    for overrides, option in options(cfg, capacity.has_bf16):
        try:
            found = estimator(option)
        except EstimateUnavailable:
            continue
        if found.peak <= FIT_FRACTION * capacity.bytes:
            return overrides, found
    return None


Changes = dict[str, dict[str, Any]]  # config group -> field -> value


def options(cfg: TrainConfig, has_bf16: bool = True) -> Iterator[tuple[list[str], TrainConfig]]:
    """The memory options in the order of their cost, each alone, then added up in that order
    (bf16, + checkpointing, + accumulation, + fsdp): (the overrides, the config they make)."""
    singles = list(single_options(cfg, has_bf16))
    for overrides, changes in singles:
        option = apply(cfg, changes)
        if option is not None:
            yield overrides, option
    merged: Changes = {}
    named: dict[str, str] = {}  # key -> value, in the order first named
    for i, (overrides, changes) in enumerate(singles):
        for group, values in changes.items():
            merged.setdefault(group, {}).update(values)
        for override in overrides:
            key, _, value = override.partition("=")
            named[key] = value
        option = apply(cfg, merged)
        if i > 0 and option is not None:
            yield [f"{key}={value}" for key, value in named.items()], option


def single_options(cfg: TrainConfig, has_bf16: bool = True) -> Iterator[tuple[list[str], Changes]]:
    """bf16 (free on a GPU that has it; fp16 on one that has not), activation checkpointing (one
    more forward per block), accumulation (half the batch, twice the steps: the same gradient;
    down to an eighth), fsdp at this world size, then (slurm) on 2, 4 and 8 times the nodes."""
    memory, data, optim, parallelism = cfg.memory, cfg.data, cfg.optim, cfg.parallelism
    if memory.amp == "none":
        amp = "bf16" if has_bf16 else "fp16"
        yield [f"memory.amp={amp}"], {"memory": {"amp": amp}}
    if not memory.activation_checkpointing:
        yield ["memory.activation_checkpointing=true"], {"memory": {"activation_checkpointing": True}}
    batch, steps = data.batch_size, optim.grad_accum_steps
    for _ in range(3):
        if batch < 2:
            break
        batch, steps = batch // 2, steps * 2
        yield [f"data.batch_size={batch}", f"optim.grad_accum_steps={steps}"], \
            {"data": {"batch_size": batch}, "optim": {"grad_accum_steps": steps}}
    if parallelism.strategy == "ddp" and parallelism.world_size > 1:
        yield ["parallelism.strategy=fsdp"], {"parallelism": {"strategy": "fsdp"}}
    if cfg.cluster.mode == "slurm":
        for times in (2, 4, 8):
            nodes = parallelism.nodes * times
            yield ["parallelism.strategy=fsdp", f"parallelism.nodes={nodes}"], \
                {"parallelism": {"strategy": "fsdp", "nodes": nodes}}


def apply(cfg: TrainConfig, changes: Changes) -> TrainConfig | None:
    """``cfg`` with ``changes`` (group -> field -> value); None when that combination is invalid
    (fsdp with fp16: the groups' own checks say so)."""
    try:
        groups = {group: dataclasses.replace(getattr(cfg, group), **values)
                  for group, values in changes.items()}
        return dataclasses.replace(cfg, **groups)
    except ConfigError:
        return None


# ------------------------------------------------------------------------------------------------
# Through the run directory into summary.json


def write_report(run_dir: Path, report: MemoryReport) -> None:
    """Before submission: rank 0's summary picks it up (``read_report``) beside the measured peak."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(run_dir / ESTIMATE_FILE, report.as_dict(), indent=2)


def read_report(run_dir: Path) -> dict[str, Any] | None:
    """The estimate written before submission; None when there is none or it does not parse (the
    summary must not fail over a note)."""
    try:
        found = json.loads((run_dir / ESTIMATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def calibration(summary: dict[str, Any]) -> str | None:
    """A GPU run's estimate beside its measured peak (the largest rank's allocated bytes), for the
    end of the run; None on CPU, where the measured peak is the process's RSS and not comparable."""
    found = summary.get("memory_estimate") or {}
    measured = [p for p in summary.get("peak_mem_bytes_per_rank") or [] if p]
    if not found.get("on_gpu") or not found.get("estimate_bytes") or not measured:
        return None
    peak = found["estimate_bytes"]["peak"]
    return (f"memory: estimated {gib(peak)} per rank, measured {gib(max(measured))} (max allocated): "
            f"estimate / measured = {peak / max(measured):.2f}")

