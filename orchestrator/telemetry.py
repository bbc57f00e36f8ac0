"""Per-GPU and per-rank memory telemetry: preflight, a sampler per node, the run's summary and its plot.

Two mistakes cost whole allocations and show only in hindsight: a "multi-GPU" job whose ranks all run
on GPU 0 (the others idle), and GPU 0 holding several GiB more than its peers because every rank
loaded something onto ``cuda:0``. This module makes both visible while the job runs and flags them in
the summary.

Layout under ``RUN/telemetry/``::

    <node>.jsonl          one JSON line per sample, written by that node's sampler (local rank 0)
    ranks/rank-<R>.json   written by each rank at start: who it is, its pid and its device
    peaks/rank-<R>.json   written by each rank at the end: torch's peak memory, or peak RSS on CPU

NVML is reached only through one :class:`NvmlApi` object, from :func:`load_nvml` or injected by a
caller (tests pass a fake). Without NVIDIA's driver the sampler records each rank's CPU memory
(RSS/USS) instead, into the same files. GPU numbers in messages are NVML's (``nvidia-smi``'s), which
equal CUDA ordinals only when ``CUDA_VISIBLE_DEVICES`` is unset.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, TextIO

import psutil

from orchestrator import atomic

try:
    import pynvml as _pynvml
except ImportError:  # nvidia-ml-py is a dependency, but a broken install must not stop training
    _pynvml = None

Record = dict[str, Any]
NvmlChoice = Literal["auto"]

GIB = 1 << 30
MIB = 1 << 20

DEFAULT_INTERVAL_S = 5.0  # one sample costs well under a millisecond; 5 s still catches a slow leak

# Idle: NVML utilisation is the share of the last ~1/6-1 s a kernel ran; a training GPU averages far
# above 5 %, and a CUDA context plus NCCL buffers (~0.5-1 GiB) stays under 5 % of a 24-80 GiB card.
IDLE_UTIL_PCT = 5.0
IDLE_PEAK_FRACTION = 0.05
# A job that stopped during start-up (data loading, compilation) never had the chance to use its GPUs.
MIN_SAMPLES_FOR_IDLE = 3

# Imbalance: DDP replicas hold the same model, gradients and optimizer state, so their peaks agree
# within ~10-20 %. 1.5x the median of the peers is a different workload; the absolute floor keeps
# small models (0.3 vs 0.6 GiB of context and workspace) from being flagged.
IMBALANCE_RATIO = 1.5
IMBALANCE_MIN_EXCESS_BYTES = 1 * GIB

# A stray CUDA context alone is ~300 MiB; below 16 MiB NVML's per-process figure is driver bookkeeping.
CROSS_DEVICE_MIN_BYTES = 16 * MIB

# Preflight: less free than this before training means another job or a stale process holds the GPU.
PREFLIGHT_FREE_WARN_FRACTION = 0.9

# USS comes from /proc/<pid>/smaps_rollup, which walks the rank's page tables (~20 us per resident MiB:
# 0.2 s for a 10 GiB rank) while holding the rank's mmap lock. RSS (statm) costs microseconds and is
# read every sample; each rank's USS is read again only after 100x its last read's cost has passed.
USS_MAX_DUTY_FRACTION = 0.01

CPU_MODE_INFO = "GPU telemetry off (no NVIDIA driver): recording CPU memory per rank instead"


class TelemetryError(RuntimeError):
    """Telemetry files are missing or unusable (plotting a run that recorded nothing, ...)."""


class PreflightError(TelemetryError):
    """The GPUs this node shows do not match what the job asked for; training would waste the allocation."""


class NvmlApi(Protocol):
    """The handful of pynvml functions this module uses; the ``pynvml`` module itself satisfies it."""

    def nvmlDeviceGetCount(self) -> int: ...

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...

    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...  # .used .total .free, bytes

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...  # .gpu, percent

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]: ...  # .pid .usedGpuMemory


# What NVML raises when a query is refused (no permission in a container, GPU fell off the bus).
_NVML_ERRORS: tuple[type[BaseException], ...] = \
    (OSError,) if _pynvml is None else (_pynvml.NVMLError, OSError)


def load_nvml() -> NvmlApi | None:
    """NVML, initialised; None where NVIDIA's driver (libnvidia-ml) is absent."""
    if _pynvml is None:
        return None
    try:
        _pynvml.nvmlInit()
    except _NVML_ERRORS:
        return None
    nvml: NvmlApi = _pynvml  # the module itself has every function NvmlApi names
    return nvml


def _resolve(nvml: NvmlApi | NvmlChoice | None) -> NvmlApi | None:
    return load_nvml() if nvml == "auto" else nvml


# --- which GPUs this process sees ------------------------------------------------------------------------


def visible_gpus(nvml: NvmlApi, environ: Mapping[str, str]) -> list[int | None]:
    """NVML index of each CUDA ordinal, in order: ``CUDA_VISIBLE_DEVICES=2,3`` -> ``[2, 3]``.

    ``None`` marks an entry NVML cannot report on as a whole GPU (a MIG instance). Like CUDA, the
    list stops at the first entry naming no GPU (``0,-1,1`` -> ``[0]``).
    """
    count = nvml.nvmlDeviceGetCount()
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return list(range(count))
    uuids: list[str] | None = None
    result: list[int | None] = []
    for entry in (e.strip() for e in spec.split(",")):
        if entry.startswith("MIG-"):
            result.append(None)
            continue
        if re.fullmatch(r"-?\d+", entry):
            index: int | None = int(entry) if 0 <= int(entry) < count else None
        else:
            uuids = uuids if uuids is not None else _uuids(nvml, count)
            index = _match_uuid(entry, uuids)
        if index is None:
            break
        result.append(index)
    return result


def _uuids(nvml: NvmlApi, count: int) -> list[str]:
    raw = (nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count))
    return [u.decode() if isinstance(u, bytes) else u for u in raw]


def _match_uuid(entry: str, uuids: list[str]) -> int | None:
    # CUDA accepts a unique prefix of a UUID, with or without the "GPU-" prefix
    wanted = entry if entry.startswith("GPU-") else f"GPU-{entry}"
    matches = [i for i, u in enumerate(uuids) if entry and u.startswith(wanted)]
    return matches[0] if len(matches) == 1 else None


def _describe_visible(environ: Mapping[str, str]) -> str:
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if spec is None else f"CUDA_VISIBLE_DEVICES={spec}"


# --- files each rank writes ------------------------------------------------------------------------------


def telemetry_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "telemetry"


def node_file(run_dir: Path, node: str) -> Path:
    # node names come from the launcher; keep them from escaping the directory or breaking the name
    return telemetry_dir(run_dir) / f"{re.sub(r'[^A-Za-z0-9._-]', '_', node)}.jsonl"


def _write_json_atomic(path: Path, obj: object) -> None:
    """A killed rank leaves the old file or the new one; rewritten often, so no directory fsync."""
    atomic.write_json(path, obj, durable=False)


@dataclass(frozen=True)
class RankInfo:
    """One rank as it registered itself: the sampler maps NVML's pids and its own device through this."""

    rank: int
    local_rank: int
    node: str
    pid: int
    device: int | None  # CUDA ordinal in this rank's own view; None on CPU
    cuda_visible_devices: str | None  # this rank's view, which may differ from the sampler's (gpu-bind)


def register_rank(run_dir: Path, rank: int, local_rank: int, node: str, device_index: int | None,
                  environ: Mapping[str, str] | None = None, pid: int | None = None) -> None:
    """Each rank at start: write ``telemetry/ranks/rank-<R>.json`` (``pid`` defaults to this process)."""
    env = os.environ if environ is None else environ
    info = RankInfo(rank=rank, local_rank=local_rank, node=node, pid=os.getpid() if pid is None else pid,
                    device=device_index, cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"))
    _write_json_atomic(telemetry_dir(run_dir) / "ranks" / f"rank-{rank}.json", asdict(info))


def _read_rank(path: Path) -> RankInfo | None:
    try:
        return RankInfo(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # a foreign or damaged file: that rank is simply unknown


def load_ranks(run_dir: Path) -> list[RankInfo]:
    paths = sorted((telemetry_dir(run_dir) / "ranks").glob("rank-*.json"))
    return sorted((r for r in map(_read_rank, paths) if r is not None), key=lambda r: r.rank)


def record_rank_peak(run_dir: Path, rank: int, device_index: int | None) -> Record:
    """Each rank at the end: write (and return) its peak memory to ``telemetry/peaks/rank-<R>.json``.

    On GPU: torch's peak allocated/reserved bytes on its device, and on any other device its
    allocator touched (the "loaded onto cuda:0" mistake, seen even where NVML's pids are a
    container's). Always: peak RSS (``ru_maxrss``) and current USS of the process.
    """
    usage_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    peak: Record = {"rank": rank, "device": device_index, "max_rss_bytes": usage_kib * 1024,
                    "uss_bytes": psutil.Process().memory_full_info().uss}
    if device_index is not None:
        peak.update(_cuda_peak(device_index))
    _write_json_atomic(telemetry_dir(run_dir) / "peaks" / f"rank-{rank}.json", peak)
    return peak


def _cuda_peak(device_index: int) -> Record:
    import torch  # only ranks that train on a GPU pay for importing torch here

    others = []
    for i in range(torch.cuda.device_count()):
        # reads the caching allocator's counters: creates no CUDA context on devices never used
        reserved = torch.cuda.max_memory_reserved(i)
        if i != device_index and reserved > 0:
            others.append({"device": i, "max_reserved_bytes": reserved})
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(device_index),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(device_index), "other_devices": others}


def load_peaks(run_dir: Path) -> dict[int, Record]:
    peaks: dict[int, Record] = {}
    for path in sorted((telemetry_dir(run_dir) / "peaks").glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
            peaks[int(record["rank"])] = record
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a rank killed before it wrote its peak has none
    return peaks


# --- preflight -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    index: int  # NVML index
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class PreflightReport:
    local_rank: int
    device_index: int | None  # the CUDA ordinal this rank should use; None for CPU training
    device_nvml_index: int | None
    gpus: tuple[GpuMemory, ...] = ()  # every GPU this rank sees, with its free memory now
    warnings: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line for the rank's log."""
        if self.device_index is None:
            return f"preflight local rank {self.local_rank}: CPU training, no GPU checks"
        free = ", ".join(f"GPU {g.index} {_gib(g.free_bytes)}/{_gib(g.total_bytes)} GiB" for g in self.gpus)
        nvml = "a MIG instance" if self.device_nvml_index is None else f"GPU {self.device_nvml_index}"
        line = (f"preflight local rank {self.local_rank}: cuda:{self.device_index} ({nvml}); "
                f"free memory: {free}")
        return "; ".join([line, *self.warnings])


def preflight(gpus_per_node: int, local_rank: int, local_world_size: int,
              nvml: NvmlApi | NvmlChoice | None = "auto",
              environ: Mapping[str, str] | None = None) -> PreflightReport:
    """Before training: this node shows ``gpus_per_node`` GPUs and this local rank has its own.

    Two layouts pass: every rank sees all the node's GPUs (rank uses ``cuda:<local_rank>``), or
    SLURM binds one GPU per task (each rank sees one, ``cuda:0``). Raises :class:`PreflightError`.
    """
    if gpus_per_node == 0:
        return PreflightReport(local_rank=local_rank, device_index=None, device_nvml_index=None)
    env = os.environ if environ is None else environ
    api = _resolve(nvml)
    if api is None:
        raise PreflightError(
            f"parallelism.gpus_per_node={gpus_per_node} but this node has no NVIDIA driver (NVML did not "
            f"load): run on a GPU node (--gpus-per-node={gpus_per_node}) or set "
            f"parallelism.gpus_per_node=0 for CPU training")
    visible = visible_gpus(api, env)
    device = _device_for_rank(gpus_per_node, local_rank, local_world_size, len(visible), env)
    gpus = tuple(_gpu_memory(api, i) for i in visible if i is not None)
    return PreflightReport(local_rank=local_rank, device_index=device, device_nvml_index=visible[device],
                           gpus=gpus, warnings=tuple(_busy_warnings(gpus)))


def _device_for_rank(gpus_per_node: int, local_rank: int, local_world_size: int, num_visible: int,
                     env: Mapping[str, str]) -> int:
    where = _describe_visible(env)
    if num_visible == 1 and local_world_size == gpus_per_node:
        return 0  # one GPU bound per task (--gpus-per-task=1 or --gpu-bind): every rank uses cuda:0
    if num_visible != gpus_per_node:
        raise PreflightError(
            f"parallelism.gpus_per_node={gpus_per_node} but this node shows {num_visible} GPUs ({where}): "
            f"request --gpus-per-node={gpus_per_node} or set parallelism.gpus_per_node={num_visible}")
    if local_rank >= num_visible:
        raise PreflightError(
            f"local rank {local_rank} has no GPU of its own: this node runs {local_world_size} ranks but "
            f"shows {num_visible} GPUs ({where}): launch one rank per GPU (--ntasks-per-node={num_visible})")
    if local_world_size != gpus_per_node:
        raise PreflightError(
            f"this node runs {local_world_size} ranks but parallelism.gpus_per_node={gpus_per_node}: "
            f"{gpus_per_node - local_world_size} GPU(s) would stay idle; launch one rank per GPU "
            f"(--ntasks-per-node={gpus_per_node})")
    return local_rank


def _gpu_memory(nvml: NvmlApi, index: int) -> GpuMemory:
    mem = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
    return GpuMemory(index=index, free_bytes=int(mem.free), total_bytes=int(mem.total))


def _busy_warnings(gpus: Iterable[GpuMemory]) -> Iterator[str]:
    for g in gpus:
        if g.free_bytes < PREFLIGHT_FREE_WARN_FRACTION * g.total_bytes:
            yield (f"GPU {g.index} has only {_gib(g.free_bytes)} of {_gib(g.total_bytes)} GiB free before "
                   f"training: another job or a stale process holds it (nvidia-smi shows which)")


# --- the sampler -----------------------------------------------------------------------------------------


class _RankTable:
    """This node's registered ranks, re-read as ranks (re-)register; each file is parsed once per change."""

    def __init__(self, run_dir: Path, node: str) -> None:
        self._dir = telemetry_dir(run_dir) / "ranks"
        self._node = node
        self._seen: dict[str, tuple[int, RankInfo | None]] = {}

    def refresh(self) -> list[RankInfo]:
        try:
            entries = list(os.scandir(self._dir))
        except FileNotFoundError:
            return []
        for entry in entries:
            if not (entry.name.startswith("rank-") and entry.name.endswith(".json")):
                continue
            try:
                mtime = entry.stat().st_mtime_ns
            except OSError:
                continue  # replaced or removed since the scan
            if entry.name not in self._seen or self._seen[entry.name][0] != mtime:
                self._seen[entry.name] = (mtime, _read_rank(Path(entry.path)))
        return [r for _, r in self._seen.values() if r is not None and r.node == self._node]


_Sampled = tuple[NvmlApi | None, list[int | None], str]


def _gpus_to_sample(nvml: NvmlApi | None, environ: Mapping[str, str]) -> _Sampled:
    """NVML, the GPUs this node's job sees, and the info line for CPU mode (NVML absent or failing)."""
    if nvml is None:
        return None, [], CPU_MODE_INFO
    try:
        return nvml, visible_gpus(nvml, environ), ""
    except _NVML_ERRORS as e:
        return None, [], CPU_MODE_INFO.replace("no NVIDIA driver", f"NVML cannot list GPUs: {e}")


class MemorySampler:
    """A daemon thread on local rank 0 of each node, appending one JSON line per sample.

    GPU record: ``{"t", "node", "sample_s", "gpus": [{"index", "cuda", "used_bytes", "total_bytes",
    "util_pct", "ranks", "processes": [{"pid", "rank", "used_bytes"}]}]}``; without NVML:
    ``{"t", "node", "sample_s", "ranks": [{"rank", "pid", "rss_bytes", "shared_bytes", "uss_bytes"}]}``
    (``uss_bytes`` null in samples where its rationed read was not due). It shares no
    lock with training: it only reads NVML, /proc and the rank files, and writes its own file.
    """

    def __init__(self, run_dir: Path, node: str, interval_s: float = DEFAULT_INTERVAL_S,
                 nvml: NvmlApi | NvmlChoice | None = "auto",
                 environ: Mapping[str, str] | None = None) -> None:
        if not interval_s > 0:
            raise ValueError(f"telemetry interval_s={interval_s} is invalid: must be > 0 "
                             f"(try interval_s={DEFAULT_INTERVAL_S})")
        self.path = node_file(run_dir, node)
        self.node = node
        self.interval_s = interval_s
        env = os.environ if environ is None else environ
        self._nvml, self._visible, self._cpu_mode_info = _gpus_to_sample(_resolve(nvml), env)
        self._ranks = _RankTable(run_dir, node)
        self._rank_gpu: dict[RankInfo, int | None] = {}
        self._processes: dict[int, psutil.Process] = {}
        self._uss_due: dict[int, float] = {}  # pid -> monotonic time its USS may be read again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: TextIO | None = None
        self._reported_error = False
        self._stopped = False

    @property
    def is_gpu(self) -> bool:
        return self._nvml is not None

    def start(self) -> MemorySampler:
        if not self.is_gpu:
            print(self._cpu_mode_info, flush=True)
        self._thread = threading.Thread(target=self._run, name=f"memory-sampler-{self.node}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread, take one last sample (the end of the run), close the file. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._sample_safely()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while True:
            self._sample_safely()
            if self._stop.wait(self.interval_s):
                return

    def _sample_safely(self) -> None:
        try:
            self.sample_once()
        except Exception:  # telemetry is an observer: a failed sample must never end the training run
            if not self._reported_error:
                self._reported_error = True
                print(f"memory sampler on {self.node}: a sample failed, continuing:\n"
                      f"{traceback.format_exc()}", flush=True)

    def sample_once(self) -> Record:
        """Take one sample now, append it as a line and flush (a killed job keeps what was sampled)."""
        start = time.perf_counter()
        record: Record = {"t": time.time(), "node": self.node}
        if self._nvml is not None:
            record["gpus"] = self._sample_gpus(self._nvml)
        else:
            record["ranks"] = self._sample_cpu()
        record["sample_s"] = round(time.perf_counter() - start, 6)
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115 -- held open across samples, closed in stop()
        # flush, no fsync: a killed process keeps what the kernel has; fsync would make samples cost ms
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        return record

    def _sample_gpus(self, nvml: NvmlApi) -> list[Record]:
        ranks = self._ranks.refresh()
        pid_rank = {r.pid: r.rank for r in ranks}
        own: dict[int, list[int]] = {}
        for r in ranks:
            index = self._own_gpu(nvml, r)
            if index is not None:
                own.setdefault(index, []).append(r.rank)
        indices = sorted({i for i in self._visible if i is not None} | set(own))
        return [self._gpu_record(nvml, i, pid_rank, sorted(own.get(i, []))) for i in indices]

    def _own_gpu(self, nvml: NvmlApi, rank: RankInfo) -> int | None:
        """The NVML index of the rank's device, through the rank's own CUDA_VISIBLE_DEVICES."""
        if rank not in self._rank_gpu:
            spec = rank.cuda_visible_devices
            view = visible_gpus(nvml, {} if spec is None else {"CUDA_VISIBLE_DEVICES": spec})
            ok = rank.device is not None and 0 <= rank.device < len(view)
            self._rank_gpu[rank] = view[rank.device] if ok and rank.device is not None else None
        return self._rank_gpu[rank]

    def _gpu_record(self, nvml: NvmlApi, index: int, pid_rank: Mapping[int, int], ranks: list[int]) -> Record:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        except _NVML_ERRORS as e:
            return {"index": index, "error": str(e)}
        cuda = self._visible.index(index) if index in self._visible else None
        return {"index": index, "cuda": cuda, "used_bytes": int(mem.used), "total_bytes": int(mem.total),
                "util_pct": _utilisation(nvml, handle), "ranks": ranks,
                "processes": _processes(nvml, handle, pid_rank)}

    def _sample_cpu(self) -> list[Record]:
        records = []
        for r in sorted(self._ranks.refresh(), key=lambda r: r.rank):
            memory = self._cpu_memory(r.pid)
            if memory is not None:
                records.append({"rank": r.rank, "pid": r.pid, **memory})
        return records

    def _cpu_memory(self, pid: int) -> Record | None:
        try:
            if pid not in self._processes:
                self._processes[pid] = psutil.Process(pid)
            process = self._processes[pid]
            info = process.memory_info()  # /proc/<pid>/statm: a few microseconds
            return {"rss_bytes": info.rss, "shared_bytes": info.shared, "uss_bytes": self._uss(process)}
        except psutil.NoSuchProcess:
            self._processes.pop(pid, None)
            return None  # the rank has exited (or not started yet under this pid)

    def _uss(self, process: psutil.Process) -> int | None:
        """USS when due, else None: reading it walks the rank's page tables, so its cost is rationed."""
        if time.monotonic() < self._uss_due.get(process.pid, 0.0):
            return None
        start = time.perf_counter()
        try:
            uss = int(process.memory_full_info().uss)  # /proc/<pid>/smaps_rollup
        except psutil.AccessDenied:  # another user's process: RSS is public, USS is not
            self._uss_due[process.pid] = float("inf")
            return None
        cost_s = time.perf_counter() - start
        self._uss_due[process.pid] = time.monotonic() + cost_s / USS_MAX_DUTY_FRACTION
        return uss


def _utilisation(nvml: NvmlApi, handle: Any) -> float | None:
    try:
        return float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except _NVML_ERRORS:
        return None  # some virtualised GPUs do not report it


def _processes(nvml: NvmlApi, handle: Any, pid_rank: Mapping[int, int]) -> list[Record] | None:
    try:
        listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except _NVML_ERRORS:
        return None  # NO_PERMISSION in some containers: memory and utilisation are still recorded
    return [{"pid": int(p.pid), "rank": pid_rank.get(int(p.pid)),
             "used_bytes": None if p.usedGpuMemory is None else int(p.usedGpuMemory)} for p in listed]


# --- reading the samples back ----------------------------------------------------------------------------


def load_records(run_dir: Path) -> list[Record]:
    """Every node's samples, oldest first. A line cut short by a kill is skipped."""
    records = []
    for path in sorted(telemetry_dir(run_dir).glob("*.jsonl")):
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "t" in record and "node" in record:
                    records.append(record)
    return sorted(records, key=lambda r: r["t"])


@dataclass
class GpuStats:
    """One GPU over the run, accumulated from its samples."""

    node: str
    index: int
    total_bytes: int = 0
    peak_used_bytes: int = 0
    num_samples: int = 0
    util_samples: list[float] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)  # ranks whose own device this is
    process_peaks: dict[int, int | None] = field(default_factory=dict)  # rank -> peak bytes (None: unknown)

    @property
    def mean_util_pct(self) -> float | None:
        return statistics.fmean(self.util_samples) if self.util_samples else None

    @property
    def ranks_present(self) -> set[int]:
        """Ranks that own this GPU or whose process NVML lists on it."""
        return self.ranks | set(self.process_peaks)

    @property
    def name(self) -> str:
        return f"GPU {self.index} on {self.node}"

    def add(self, gpu: Record) -> None:
        self.num_samples += 1
        self.total_bytes = int(gpu["total_bytes"])
        self.peak_used_bytes = max(self.peak_used_bytes, int(gpu["used_bytes"]))
        if gpu.get("util_pct") is not None:
            self.util_samples.append(float(gpu["util_pct"]))
        self.ranks.update(gpu.get("ranks") or [])
        for p in gpu.get("processes") or []:
            if p.get("rank") is not None:
                self._add_process(int(p["rank"]), p.get("used_bytes"))

    def _add_process(self, rank: int, used: int | None) -> None:
        if rank not in self.process_peaks:
            self.process_peaks[rank] = used
        elif used is not None:
            self.process_peaks[rank] = max(self.process_peaks[rank] or 0, used)


def gpu_stats(records: Iterable[Record]) -> list[GpuStats]:
    stats: dict[tuple[str, int], GpuStats] = {}
    for record in records:
        for gpu in record.get("gpus") or []:
            if "error" not in gpu:
                key = (str(record["node"]), int(gpu["index"]))
                stats.setdefault(key, GpuStats(*key)).add(gpu)
    return [stats[k] for k in sorted(stats)]


@dataclass
class RankStats:
    """One rank's CPU memory over the run (sampled in CPU mode only)."""

    rank: int
    node: str
    pid: int
    peak_rss_bytes: int = 0
    peak_uss_bytes: int | None = None


def rank_stats(records: Iterable[Record]) -> list[RankStats]:
    stats: dict[int, RankStats] = {}
    for record in records:
        for r in record.get("ranks") or []:
            rank = int(r["rank"])
            s = stats.setdefault(rank, RankStats(rank, str(record["node"]), int(r["pid"])))
            s.peak_rss_bytes = max(s.peak_rss_bytes, int(r["rss_bytes"]))
            if r.get("uss_bytes") is not None:
                s.peak_uss_bytes = max(s.peak_uss_bytes or 0, int(r["uss_bytes"]))
    return [stats[k] for k in sorted(stats)]


# --- flags -----------------------------------------------------------------------------------------------


def _gib(n: float) -> str:
    return f"{n / GIB:.1f}"


def _rank_list(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    if not ordered:
        return "no rank"
    return ("rank " if len(ordered) == 1 else "ranks ") + ", ".join(map(str, ordered))


def is_idle(gpu: GpuStats) -> bool:
    util = gpu.mean_util_pct
    return (gpu.num_samples >= MIN_SAMPLES_FOR_IDLE and util is not None and util < IDLE_UTIL_PCT
            and gpu.peak_used_bytes < IDLE_PEAK_FRACTION * gpu.total_bytes)


def idle_flags(gpus: list[GpuStats]) -> list[str]:
    """A GPU the job holds that did no work; names the GPU that several ranks crowd onto, if any."""
    flags = []
    for g in filter(is_idle, gpus):
        flag = (f"{g.name} ({_rank_list(g.ranks)}) stayed idle: mean utilisation {g.mean_util_pct:.0f}%, "
                f"peak {_gib(g.peak_used_bytes)} of {_gib(g.total_bytes)} GiB")
        for c in (c for c in gpus if c is not g and c.node == g.node and len(c.ranks_present) > 1):
            flag += (f"; {_rank_list(c.ranks_present)} all run on GPU {c.index}: "
                     f"call torch.cuda.set_device(local_rank) in each rank before creating tensors")
        flags.append(flag)
    return flags


def _outliers(values: Mapping[Any, float]) -> Iterator[tuple[Any, float]]:
    """Keys whose value exceeds IMBALANCE_RATIO x the median of the others by IMBALANCE_MIN_EXCESS_BYTES."""
    for key, value in values.items():
        peers = [v for k, v in values.items() if k != key]
        if not peers:
            continue
        median = statistics.median(peers)
        if value > IMBALANCE_RATIO * median and value - median > IMBALANCE_MIN_EXCESS_BYTES:
            yield key, median


def _ratio(value: float, median: float) -> str:
    return f"{value / median:.1f}x the median of its peers ({_gib(median)} GiB)" if median > 0 \
        else "while its peers hold none"


def heavy_gpus(gpus: list[GpuStats]) -> list[tuple[GpuStats, float]]:
    """GPUs holding far more than the job's other working GPUs, with their peers' median peak.

    Idle GPUs are no yardstick (and are flagged on their own): peers are all working GPUs of the
    job, across nodes, so "GPU 0 heavy on every node" still stands out against GPUs 1-3.
    """
    working = {(g.node, g.index): g for g in gpus if not is_idle(g)}
    return [(working[k], median)
            for k, median in _outliers({k: float(g.peak_used_bytes) for k, g in working.items()})]


def imbalance_flags(gpus: list[GpuStats]) -> list[str]:
    flags = []
    for g, median in heavy_gpus(gpus):
        guests = sorted(set(g.process_peaks) - g.ranks)
        cause = (f"{_rank_list(guests)} also hold memory here: something is loaded onto this GPU by "
                 f"every rank? load checkpoints with map_location='cpu'" if guests
                 else "something is loaded onto this GPU by every rank? load checkpoints with "
                      "map_location='cpu'; or one rank keeps extra tensors (metrics, evaluation)")
        flags.append(f"{g.name} peaked at {_gib(g.peak_used_bytes)} GiB, "
                     f"{_ratio(g.peak_used_bytes, median)}: {cause}")
    return flags


def cross_device_flags(gpus: list[GpuStats], ranks: Mapping[int, RankInfo],
                       peaks: Mapping[int, Record]) -> list[str]:
    """A rank holding memory on a GPU other than its own: NVML's process lists, else torch's allocator."""
    own = {(g.node, r): g.index for g in gpus for r in g.ranks}
    flags, flagged = [], set()
    for g in gpus:
        for rank, used in sorted(g.process_peaks.items()):
            mine = own.get((g.node, rank))
            if mine is None or mine == g.index or (used is not None and used < CROSS_DEVICE_MIN_BYTES):
                continue
            amount = "an unknown amount" if used is None else f"{_gib(used)} GiB"
            pid = f" (pid {ranks[rank].pid})" if rank in ranks else ""
            flags.append(f"rank {rank}{pid} holds {amount} on {g.name}, its own device is GPU {mine}: "
                         f"call torch.cuda.set_device(local_rank) first and load with map_location='cpu'")
            flagged.add(rank)
    for rank, peak in sorted(peaks.items()):
        if rank not in flagged:
            flags += _torch_cross_device(rank, peak)
    return flags


def _torch_cross_device(rank: int, peak: Record) -> list[str]:
    return [f"rank {rank} reserved {_gib(o['max_reserved_bytes'])} GiB on cuda:{o['device']} through torch, "
            f"its own device is cuda:{peak.get('device')}: call torch.cuda.set_device(local_rank) first "
            f"and load with map_location='cpu'"
            for o in peak.get("other_devices") or [] if o["max_reserved_bytes"] >= CROSS_DEVICE_MIN_BYTES]


def uss_imbalance_flags(stats: list[RankStats]) -> list[str]:
    """CPU mode: a rank whose private memory (USS) is far above its peers'."""
    by_rank = {s.rank: s for s in stats if s.peak_uss_bytes is not None}
    flags = []
    for rank, median in _outliers({r: float(s.peak_uss_bytes or 0) for r, s in by_rank.items()}):
        s = by_rank[rank]
        flags.append(f"rank {rank} on {s.node} peaked at {_gib(s.peak_uss_bytes or 0)} GiB of private memory "
                     f"(USS), {_ratio(s.peak_uss_bytes or 0, median)}: it keeps something the others "
                     f"do not (evaluation data, a second copy of the dataset?)")
    return flags


# --- the summary -----------------------------------------------------------------------------------------


def summarize(run_dir: Path) -> Record:
    """The ``memory`` section of summary.json: per-GPU and per-rank peaks, and flags. JSON-serialisable.

    Works on a run still in progress (it reads what has been sampled so far) and on one that
    recorded nothing (mode ``"none"``).
    """
    return _summarize(run_dir, load_records(run_dir))


def _summarize(run_dir: Path, records: list[Record]) -> Record:
    ranks = {r.rank: r for r in load_ranks(run_dir)}
    peaks = load_peaks(run_dir)
    gpus, cpu_ranks = gpu_stats(records), rank_stats(records)
    flags = idle_flags(gpus) + imbalance_flags(gpus) + cross_device_flags(gpus, ranks, peaks) \
        + uss_imbalance_flags(cpu_ranks)
    return {"mode": "gpu" if gpus else "cpu" if cpu_ranks else "none",
            **_sampling(records),
            "gpus": [_gpu_summary(g) for g in gpus],
            "ranks": _ranks_summary(ranks, peaks, cpu_ranks),
            "nodes": _node_totals(records),
            "flags": flags,
            "notes": _notes(records, run_dir)}


def _sampling(records: list[Record]) -> Record:
    costs = [float(r["sample_s"]) for r in records if "sample_s" in r]
    return {"num_samples": len(records),
            "duration_s": round(records[-1]["t"] - records[0]["t"], 3) if records else 0.0,
            "sample_cost_ms": {"mean": round(1e3 * statistics.fmean(costs), 3) if costs else None,
                               "max": round(1e3 * max(costs), 3) if costs else None}}


def _gpu_summary(g: GpuStats) -> Record:
    util = g.mean_util_pct
    return {"node": g.node, "index": g.index, "total_bytes": g.total_bytes,
            "peak_used_bytes": g.peak_used_bytes,
            "mean_util_pct": None if util is None else round(util, 1), "ranks": sorted(g.ranks),
            "processes": [{"rank": r, "peak_used_bytes": b} for r, b in sorted(g.process_peaks.items())]}


def _ranks_summary(ranks: Mapping[int, RankInfo], peaks: Mapping[int, Record],
                   cpu_ranks: list[RankStats]) -> list[Record]:
    sampled = {s.rank: s for s in cpu_ranks}
    result = []
    for rank in sorted(set(ranks) | set(peaks) | set(sampled)):
        info, s = ranks.get(rank), sampled.get(rank)
        result.append({"rank": rank, "node": info.node if info else (s.node if s else None),
                       "local_rank": info.local_rank if info else None, "pid": info.pid if info else None,
                       "device": info.device if info else None,
                       "peak_rss_bytes": s.peak_rss_bytes if s else None,
                       "peak_uss_bytes": s.peak_uss_bytes if s else None,
                       "end": peaks.get(rank)})
    return result


def _node_totals(records: list[Record]) -> list[Record]:
    """CPU mode: the node's peak of summed RSS (counts shared pages once per rank) and summed USS (private).

    Summed USS near summed RSS means every rank holds its own copy (a dataset loaded per process);
    summed USS far below it means the ranks share pages (memory-mapped shards, fork). USS is read
    less often than RSS, so each rank's last reading stands in until the next.
    """
    totals: dict[str, Record] = {}
    last_uss: dict[tuple[str, int], int] = {}
    for record in records:
        if not record.get("ranks"):
            continue
        node = record["node"]
        t = totals.setdefault(node, {"node": node, "peak_total_rss_bytes": 0, "peak_total_uss_bytes": 0})
        for r in record["ranks"]:
            if r.get("uss_bytes") is not None:
                last_uss[(node, r["rank"])] = r["uss_bytes"]
        rss = sum(r["rss_bytes"] for r in record["ranks"])
        uss = sum(last_uss.get((node, r["rank"]), 0) for r in record["ranks"])
        t["peak_total_rss_bytes"] = max(t["peak_total_rss_bytes"], rss)
        t["peak_total_uss_bytes"] = max(t["peak_total_uss_bytes"], uss)
    return [totals[n] for n in sorted(totals)]


def _notes(records: list[Record], run_dir: Path) -> list[str]:
    notes = []
    if not records:
        notes.append(f"no telemetry samples in {telemetry_dir(run_dir)}: was the memory sampler started?")
    listed = [p for r in records for g in r.get("gpus") or [] for p in g.get("processes") or []]
    if listed and all(p.get("rank") is None for p in listed):
        notes.append("NVML's process ids match no rank's pid (a container's PID namespace?): per-rank GPU "
                     "memory comes from torch's allocator at the end of the run only")
    return notes


def format_summary(memory: Record) -> str:
    """The memory section as text, for ``switchyard status``."""
    lines = [f"memory ({memory['mode']}, {memory['num_samples']} samples over {memory['duration_s']:.0f} s, "
             f"{memory['sample_cost_ms']['mean'] or 0:.2f} ms per sample)"]
    for g in memory["gpus"]:
        util = "  n/a" if g["mean_util_pct"] is None else f"{g['mean_util_pct']:4.0f}%"
        lines.append(f"  {g['node']} GPU {g['index']}: peak {_gib(g['peak_used_bytes']):>5} / "
                     f"{_gib(g['total_bytes'])} GiB, mean util {util}, {_rank_list(g['ranks'])}")
    if memory["mode"] == "cpu":
        for r in memory["ranks"]:
            uss = "n/a" if r["peak_uss_bytes"] is None else _gib(r["peak_uss_bytes"])
            lines.append(f"  {r['node']} rank {r['rank']}: peak RSS {_gib(r['peak_rss_bytes'] or 0)} GiB, "
                         f"USS {uss} GiB")
        for n in memory["nodes"]:
            lines.append(f"  {n['node']} all ranks: peak RSS {_gib(n['peak_total_rss_bytes'])} GiB, "
                         f"USS {_gib(n['peak_total_uss_bytes'])} GiB")
    lines += [f"  ! {flag}" for flag in memory["flags"]] + [f"  note: {note}" for note in memory["notes"]]
    return "\n".join(lines)


# --- the plot --------------------------------------------------------------------------------------------


def plot_run(run_dir: Path, out: Path | None = None) -> Path:
    """Memory over time, one subplot per node, one line per GPU (per rank on CPU) -> a PNG path.

    Default output: ``RUN/telemetry/memory.png``. Raises :class:`TelemetryError` when nothing was
    sampled or matplotlib is missing.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise TelemetryError("plotting needs matplotlib: pip install matplotlib") from e
    records = load_records(run_dir)
    if not records:
        raise TelemetryError(f"no telemetry samples in {telemetry_dir(run_dir)}: was the memory sampler "
                             f"started (it runs on local rank 0 of each node)?")
    marks = _verdicts(gpu_stats(records))
    flags = _summarize(run_dir, records)["flags"]
    nodes = sorted({r["node"] for r in records})
    # the Figure/Agg API touches no pyplot global state, so plotting is safe from any thread
    figure = Figure(figsize=(10, 3.2 * len(nodes) + 0.25 * min(len(flags), 8) + 0.6))
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(nodes), 1, squeeze=False)[:, 0]
    for ax, node in zip(axes, nodes, strict=True):
        _plot_node(ax, [r for r in records if r["node"] == node], records[0]["t"], node, marks)
    _plot_titles(figure, Path(run_dir).name, flags)
    path = Path(out) if out is not None else telemetry_dir(run_dir) / "memory.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def _verdicts(stats: list[GpuStats]) -> dict[tuple[str, int], str]:
    marks = {(g.node, g.index): "idle" for g in stats if is_idle(g)}
    for g, median in heavy_gpus(stats):
        marks[(g.node, g.index)] = f"{g.peak_used_bytes / median:.1f}x peers" if median > 0 else "heavy"
    return marks


def _plot_node(ax: Any, records: list[Record], t0: float, node: str,
               marks: Mapping[tuple[str, int], str]) -> None:
    """One node's lines; a GPU's legend entry carries its verdict ("idle", "2.1x peers")."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for record in records:
        x = record["t"] - t0
        for g in record.get("gpus") or []:
            if "error" not in g:
                mark = marks.get((node, g["index"]))
                label = f"GPU {g['index']} ({_gib(g['total_bytes'])} GiB){f', {mark}' if mark else ''}"
                _append(series, label, x, g["used_bytes"])
        for r in record.get("ranks") or []:
            _append(series, f"rank {r['rank']} RSS", x, r["rss_bytes"])
            if r.get("uss_bytes") is not None:
                _append(series, f"rank {r['rank']} USS", x, r["uss_bytes"])
    colours: dict[str, str] = {}  # one colour per GPU or rank: a rank's RSS solid, its USS dashed
    for label, (xs, ys) in series.items():  # first-seen order: GPUs and ranks by number
        colour = colours.setdefault(label.removesuffix(" USS").removesuffix(" RSS"), f"C{len(colours) % 10}")
        style = "--" if label.endswith("USS") else "-"
        ax.plot(xs, ys, label=label, color=colour, linestyle=style, marker=".", markersize=3)
    ax.set_title(node)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("memory used (GiB)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small", ncol=2)


def _append(series: dict[str, tuple[list[float], list[float]]], label: str, x: float, used: int) -> None:
    xs, ys = series.setdefault(label, ([], []))
    xs.append(x)
    ys.append(used / GIB)


def _plot_titles(figure: Any, run_name: str, flags: list[str]) -> None:
    figure.suptitle(f"{run_name}: memory over time, {len(flags)} flag{'s' * (len(flags) != 1)}")
    shown = [f"! {f[:150]}" for f in flags[:8]]
    shown += [f"... and {len(flags) - 8} more"] if len(flags) > 8 else []
    line_height = 0.25 / figure.get_figheight()  # 0.25 inch per flag line, as a fraction of the figure
    bottom = 0.02 + line_height * len(shown)
    for i, line in enumerate(shown):
        figure.text(0.01, bottom - (i + 1) * line_height, line, fontsize=7, color="firebrick")
    figure.tight_layout(rect=(0, bottom, 1, 0.96))
