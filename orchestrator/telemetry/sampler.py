"""The memory sampler: a thread on local rank 0 of each node, one JSON line per sample.

Without NVIDIA's driver it records each rank's CPU memory (RSS/USS) instead, into the same files.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import psutil

from orchestrator.telemetry.common import Record
from orchestrator.telemetry.files import RankInfo, node_file, read_rank, telemetry_dir
from orchestrator.telemetry.fold import NodeFold
from orchestrator.telemetry.nvml import NVML_ERRORS, NvmlApi, NvmlChoice, resolve_nvml, visible_gpus
from orchestrator.telemetry.summary import sampler_fold

DEFAULT_INTERVAL_S = 5.0  # a sample: ~9 ms through NVML on an H100 node; 5 s still catches a slow leak

# USS comes from /proc/<pid>/smaps_rollup, which walks the rank's page tables (~20 us per resident MiB:
# 0.2 s for a 10 GiB rank) while holding the rank's mmap lock. RSS (statm) costs microseconds and is
# read every sample; each rank's USS is read again only after 100x its last read's cost has passed.
USS_MAX_DUTY_FRACTION = 0.01

# How long stop() waits for a sample in progress: one takes milliseconds (~9 ms on an H100 node), so only a
# stuck NVML call (a GPU fallen off the bus) comes near it.
STOP_TIMEOUT_S = 10.0

CPU_MODE_INFO = "GPU telemetry off (no NVIDIA driver): recording CPU memory per rank instead"


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
                self._seen[entry.name] = (mtime, read_rank(Path(entry.path)))
        return [r for _, r in self._seen.values() if r is not None and r.node == self._node]


_Sampled = tuple[NvmlApi | None, list[int | None], str]


def _gpus_to_sample(nvml: NvmlApi | None, environ: Mapping[str, str],
                    cuda_uuids: Sequence[str] | None) -> _Sampled:
    """NVML, the GPUs this node's job sees, and the info line for CPU mode (NVML absent or failing)."""
    if nvml is None:
        return None, [], CPU_MODE_INFO
    try:
        return nvml, visible_gpus(nvml, environ, cuda_uuids), ""
    except NVML_ERRORS as e:
        return None, [], CPU_MODE_INFO.replace("no NVIDIA driver", f"NVML cannot list GPUs: {e}")


class MemorySampler:
    """A daemon thread on local rank 0 of each node, appending one JSON line per sample.

    GPU record: ``{"t", "node", "sample_s", "gpus": [{"index", "cuda", "used_bytes", "total_bytes",
    "util_pct", "ranks", "processes": [{"pid", "rank", "used_bytes"}]}]}``; without NVML:
    ``{"t", "node", "sample_s", "ranks": [{"rank", "pid", "rss_bytes", "shared_bytes", "uss_bytes"}]}``
    (``uss_bytes`` null in samples where its rationed read was not due). Every record also
    carries ``"attempt"`` (the job's requeue count: a requeued job samples into the same file),
    and the last one of an attempt ``"ended"``: why its ``with`` block was left ("finished", a
    stop's ``stop_reason`` such as TIME_LIMIT, or the exception's name), so the plot can break its
    lines there and say why. It shares no
    lock with training: it only reads NVML, /proc and the rank files, and writes its own file.
    """

    def __init__(self, run_dir: Path, node: str, interval_s: float = DEFAULT_INTERVAL_S,
                 nvml: NvmlApi | NvmlChoice | None = "auto",
                 environ: Mapping[str, str] | None = None,
                 cuda_uuids: Sequence[str] | None = None, attempt: int = 0) -> None:
        """``cuda_uuids``: each CUDA ordinal's UUID from CUDA, where the caller has CUDA (a training
        rank); without them the GPUs are taken from ``CUDA_VISIBLE_DEVICES`` (see ``nvml``).
        ``attempt``: the job's requeue count (``DistEnv.restart_count``)."""
        if not interval_s > 0:
            raise ValueError(f"telemetry interval_s={interval_s} is invalid: must be > 0 "
                             f"(try interval_s={DEFAULT_INTERVAL_S})")
        self.path = node_file(run_dir, node)
        self._run_dir = Path(run_dir)
        self.node = node
        self.interval_s = interval_s
        self.attempt = attempt
        self._ended: str | None = None  # set for the last sample: why the attempt ended
        env = os.environ if environ is None else environ
        self._nvml, self._visible, self._cpu_mode_info = _gpus_to_sample(resolve_nvml(nvml), env, cuda_uuids)
        self._ranks = _RankTable(run_dir, node)
        self._rank_gpu: dict[RankInfo, int | None] = {}
        self._processes: dict[int, psutil.Process] = {}
        self._uss_due: dict[int, float] = {}  # pid -> monotonic time its USS may be read again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._file: BinaryIO | None = None
        self._fold: NodeFold | None = None
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

    def stop(self, timeout_s: float = STOP_TIMEOUT_S, ended: str = "finished") -> None:
        """Stop the thread, take one last sample (the end of the run, marked ``ended``), close the
        file. Idempotent.

        A thread still sampling after ``timeout_s`` is left behind (it is a daemon) with a warning:
        an NVML call stuck on a failed GPU must not hold rank 0 back from the final barrier, where
        every other rank would wait for it until the collective timeout."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                print(f"memory sampler on {self.node}: its sample did not return within {timeout_s:g} s "
                      f"(an NVML call stuck on a failed GPU? nvidia-smi on {self.node} shows it): going "
                      f"on without the last sample", flush=True)
                return  # the stuck thread still owns the file; the process's exit closes it
            self._thread = None
        self._ended = ended
        self._sample_safely()
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> MemorySampler:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        self.stop(ended="finished" if exc is None else
                  str(getattr(exc, "stop_reason", "") or type(exc).__name__))

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
        record: Record = {"t": time.time(), "node": self.node, "attempt": self.attempt}
        if self._nvml is not None:
            record["gpus"] = self._sample_gpus(self._nvml)
        else:
            record["ranks"] = self._sample_cpu()
        record["sample_s"] = round(time.perf_counter() - start, 6)
        if self._ended is not None:
            record["ended"] = self._ended
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab")  # noqa: SIM115 -- held open across samples, closed in stop()
            try:
                # what earlier attempts sampled into this file, and the memory section kept with it
                self._fold = sampler_fold(self._run_dir, self.path)
            except Exception as e:  # a damaged fold or line of an earlier attempt: the samples go on,
                self._fold = None  # and readers fold the raw file's tail, saying so
                print(f"memory sampler on {self.node}: cannot resume the fold of {self.path} "
                      f"({type(e).__name__}: {e}); sampling on without one", flush=True)
        # flush, no fsync: a killed process keeps what the kernel has; fsync would make samples cost ms
        self._file.write((json.dumps(record) + "\n").encode())
        self._file.flush()
        if self._fold is not None:
            self._fold.add(record, self._file.tell())  # the fold, written beside: what status reads
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
        """The NVML index of the rank's device: by its UUID, else through its own CUDA_VISIBLE_DEVICES."""
        if rank not in self._rank_gpu and rank.device_uuid is not None:
            self._rank_gpu[rank] = visible_gpus(nvml, {}, [rank.device_uuid])[0]
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
        except NVML_ERRORS as e:
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
    except NVML_ERRORS:
        return None  # some virtualised GPUs do not report it


def _processes(nvml: NvmlApi, handle: Any, pid_rank: Mapping[int, int]) -> list[Record] | None:
    try:
        listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except NVML_ERRORS:
        return None  # NO_PERMISSION in some containers: memory and utilisation are still recorded
    return [{"pid": int(p.pid), "rank": pid_rank.get(int(p.pid)),
             "used_bytes": None if p.usedGpuMemory is None else int(p.usedGpuMemory)} for p in listed]
