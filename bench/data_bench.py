"""Data-layer benchmark: every reader side by side on the same generated data, in one run.

What it measures (docs/performance.md, "Data layer", holds the tables and how to read them):

1. Random per-sample reads, page cache warm: samples/s, GB/s and the ratio to a zero-copy
   baseline (one memmap + offsets), for the Switchyard reader, MosaicML streaming (MDS),
   litdata, ``torch.load`` of a list of tensors and ``torch.load(mmap=True)`` of the same file.
   Every reader visits the same random permutation and touches each sample with a numpy
   ``.sum()`` (torch tensors are viewed as numpy, zero-copy), so lazy readers really read.
   One sequential pass warms the page cache first; the best of ``--repeats`` passes is kept.
2. Memory with 4 processes reading the whole dataset (random order): per-process USS and PSS
   and their sums (psutil ``memory_full_info``), while all 4 are alive.
3. End to end through torch's DataLoader, batches of 64 padded samples, 0 and 2 workers: the
   batched path (``sharding.make_loader``) vs ``torch.load(mmap=True)`` + a per-sample Dataset
   + a padding collate (``pad_sequence``). Each batch is touched (one float per 4 KiB page of
   ``x``) so batches built lazily in shared memory are really received. Beside samples/s, the
   least memory traffic each pipeline needs (samples read once + padded ``x`` written) in GB/s
   and as a fraction of the machine's copy ceiling, measured in the same run
   (``copy_bandwidth``: numpy copies on every core).

The data: float32 samples of 16..512 rows (uniform) x 64 columns, ``--size-gb`` in all (1 GB:
14,796 samples), seed fixed, written once per format under ``--cache-dir`` and reused.

How to run. The full comparison needs mosaicml-streaming and litdata, which go in a venv of
their own (never the project's: mosaicml-streaming pins numpy < 2.2 and pulls torchvision)::

    python3 -m venv /tmp/bench-venv
    /tmp/bench-venv/bin/pip install torch==2.13.0        # FIRST: the local CPU wheel
    printf 'torch==2.13.0\\nnumpy<2.2\\n' > /tmp/bench-constraints.txt
    /tmp/bench-venv/bin/pip install -c /tmp/bench-constraints.txt mosaicml-streaming litdata
    # PyPI's torchvision has no CPU build matching torch 2.13.0+cpu and fails at import;
    # streaming imports its vision module eagerly, so this script stubs streaming.vision.
    /tmp/bench-venv/bin/pip uninstall -y torchvision
    /tmp/bench-venv/bin/pip install -c /tmp/bench-constraints.txt --no-deps -e /work/main
    /tmp/bench-venv/bin/pip install -c /tmp/bench-constraints.txt submitit hydra-core \\
        omegaconf xxhash tqdm psutil nvidia-ml-py                  # the project's light deps
    cd /work/main && /tmp/bench-venv/bin/python bench/data_bench.py --markdown /tmp/data_bench.md

Without the anchors, from the project venv::

    cd /work/main && .venv/bin/python bench/data_bench.py --skip-anchors
    .venv/bin/python bench/data_bench.py --quick --skip-anchors       # 0.1 GB smoke run

Top-level imports stay light (no torch): the memory bench spawns fresh processes that import
this file, and a Switchyard reader process should not pay for torch it does not use.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import importlib.util
import io
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import statistics
import sys
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import sharding

COLUMNS = 64
MIN_ROWS, MAX_ROWS = 16, 512
BATCH_SIZE = 64
NUM_PROCESSES = 4
WORKER_COUNTS = (0, 2)
FORMATS_VERSION = 1  # bump when the written formats change, to rewrite the cache

# ------------------------------------------------------------------------------------------------
# The data: a plan (row counts), samples regenerated from (seed, i), one directory per format


@dataclass(frozen=True)
class Plan:
    seed: int
    rows: tuple[int, ...]  # rows of each sample

    @staticmethod
    def of(size_gb: float, seed: int) -> Plan:
        mean_bytes = (MIN_ROWS + MAX_ROWS) / 2 * COLUMNS * 4
        num_samples = max(int(size_gb * 1e9 / mean_bytes), 1)
        rows = np.random.default_rng([seed, 0]).integers(MIN_ROWS, MAX_ROWS + 1, num_samples)
        return Plan(seed, tuple(rows.tolist()))

    @property
    def num_bytes(self) -> int:
        return sum(self.rows) * COLUMNS * 4

    def sample(self, i: int) -> np.ndarray:
        """float32 [rows[i], 64], the same for every format."""
        rng = np.random.default_rng([self.seed, 1, i])
        return rng.random((self.rows[i], COLUMNS), dtype=np.float32)

    def samples(self) -> Iterator[np.ndarray]:
        return (self.sample(i) for i in range(len(self.rows)))

    def permutation(self) -> list[int]:
        """The random visiting order every reader uses."""
        return np.random.default_rng([self.seed, 2]).permutation(len(self.rows)).tolist()

    def key(self) -> dict[str, Any]:
        return {"seed": self.seed, "num_samples": len(self.rows), "bytes": self.num_bytes,
                "formats_version": FORMATS_VERSION}


def write_raw(plan: Plan, out: Path) -> None:
    offsets = [0]
    with open(out / "data.bin", "wb") as f:
        for x in plan.samples():
            f.write(x.tobytes())
            offsets.append(offsets[-1] + x.size)
    np.save(out / "offsets.npy", np.asarray(offsets, np.int64))


def write_switchyard(plan: Plan, out: Path) -> None:
    with sharding.DatasetWriter(out / "ds", shard_bytes=256 * 2**20) as writer:
        for x in plan.samples():
            writer.append({"x": x})


def write_pt(plan: Plan, out: Path) -> None:
    import torch

    torch.save([torch.from_numpy(x) for x in plan.samples()], out / "list.pt")


def write_mds(plan: Plan, out: Path) -> None:
    _, mds_writer = import_mds()
    with mds_writer(out=str(out / "mds"), columns={"x": "ndarray:float32"}) as writer:
        for x in plan.samples():
            writer.write({"x": x})


def litdata_sample(item: tuple[int, int, int]) -> dict[str, Any]:
    """litdata's optimize() calls this in its worker: regenerate sample i as a tensor."""
    import torch

    i, rows, seed = item
    rng = np.random.default_rng([seed, 1, i])
    return {"x": torch.from_numpy(rng.random((rows, COLUMNS), dtype=np.float32))}


def write_litdata(plan: Plan, out: Path) -> None:
    import litdata

    items = [(i, rows, plan.seed) for i, rows in enumerate(plan.rows)]
    with contextlib.redirect_stdout(io.StringIO()):  # per-chunk progress lines
        litdata.optimize(fn=litdata_sample, inputs=items, output_dir=str(out / "litdata"),
                         chunk_bytes="64MB", num_workers=1, mode="overwrite")


WRITERS: dict[str, Callable[[Plan, Path], None]] = {
    "raw": write_raw, "switchyard": write_switchyard, "pt": write_pt, "mds": write_mds,
    "litdata": write_litdata,
}


def ensure_formats(plan: Plan, cache: Path, formats: Sequence[str]) -> None:
    """Write each format once; a finished one has done.json with the plan's key."""
    for name in formats:
        out = cache / name
        done = out / "done.json"
        if done.exists() and json.loads(done.read_text()) == plan.key():
            continue
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        started = time.perf_counter()
        WRITERS[name](plan, out)
        done.write_text(json.dumps(plan.key()))
        print(f"  wrote {name} in {time.perf_counter() - started:.1f} s", flush=True)


def recache(cache: Path, formats: Sequence[str]) -> None:
    """Give every format the same page-cache state: drop its pages, then read it sequentially.

    How a file entered the page cache decides its folio sizes: written in 64 KiB pieces, it sits
    in small folios; read back in large reads, readahead builds large ones, which a memory map
    can cover with 2 MiB entries (fewer TLB misses on random reads: measured here up to 1.7x
    faster for the same reader). Without this the comparison would measure write history.
    Called before each part: this VM's memory reclaim (DAMON, action pageout) evicts page-cache
    pages left unread for about a minute, so a part must not inherit what the last one left.
    """
    for name in formats:
        for path in sorted(p for p in (cache / name).rglob("*") if p.is_file()):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # this file's clean pages only
                while os.read(fd, 16 * 2**20):
                    pass
            finally:
                os.close(fd)


def import_mds() -> tuple[Any, Any]:
    """(LocalDataset, MDSWriter). streaming's __init__ imports its vision module, which needs a
    torchvision matching torch; none exists for CPU torch 2.13 on PyPI, and it is unused here."""
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    from streaming import LocalDataset, MDSWriter

    return LocalDataset, MDSWriter


def anchors_available() -> list[str]:
    return [m for m in ("streaming", "litdata") if importlib.util.find_spec(m) is None]


# ------------------------------------------------------------------------------------------------
# Readers: name -> opener returning get(i) -> numpy array of sample i


class ZeroCopyBaseline:
    """The physical limit: one memory map and an offsets table, a numpy view per sample."""

    def __init__(self, root: Path) -> None:
        with open(root / "data.bin", "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        offsets = np.load(root / "offsets.npy")  # int64 [n + 1], in float32 elements
        self.shapes = [(int(n), COLUMNS) for n in np.diff(offsets) // COLUMNS]
        self.byte_offsets = (offsets[:-1] * 4).tolist()  # Python ints: the fastest to index

    def __getitem__(self, i: int) -> np.ndarray:
        return np.ndarray(self.shapes[i], np.float32, self._map, self.byte_offsets[i])


Getter = Callable[[int], np.ndarray]


def open_baseline(cache: Path) -> Getter:
    return ZeroCopyBaseline(cache / "raw").__getitem__


def open_switchyard(cache: Path) -> Getter:
    ds = sharding.open_dataset(cache / "switchyard" / "ds")
    return lambda i: ds.sample(i)["x"]


def open_switchyard_torch(cache: Path) -> Getter:
    ds = sharding.open_dataset(cache / "switchyard" / "ds")
    return lambda i: ds[i]["x"].numpy()


def open_torch_load(cache: Path, *, mmap_file: bool = False) -> Getter:
    import torch

    tensors = torch.load(cache / "pt" / "list.pt", mmap=mmap_file)
    return lambda i: tensors[i].numpy()


def open_torch_mmap(cache: Path) -> Getter:
    return open_torch_load(cache, mmap_file=True)


def open_mds(cache: Path) -> Getter:
    local_dataset, _ = import_mds()
    ds = local_dataset(local=str(cache / "mds" / "mds"))
    return lambda i: ds[i]["x"]


def open_litdata(cache: Path) -> Getter:
    import litdata

    # batch_decode=0: decode the requested sample only; the default decodes its neighbours too,
    # which is wasted work for random access (266 samples/s measured with numpy samples).
    ds = litdata.StreamingDataset(str(cache / "litdata" / "litdata"), batch_decode=0)
    return lambda i: ds[i]["x"].numpy()


@dataclass(frozen=True)
class Reader:
    name: str
    opener: Callable[[Path], Getter]
    needs: str  # the format directory it reads
    uses_torch: bool = False
    anchor: bool = False


READERS = (
    Reader("zero-copy baseline (memmap + offsets)", open_baseline, "raw"),
    Reader("Switchyard `ds.sample(i)` (numpy views)", open_switchyard, "switchyard"),
    Reader("Switchyard `ds[i]` (torch tensors)", open_switchyard_torch, "switchyard", uses_torch=True),
    Reader("`torch.load` list of tensors", open_torch_load, "pt", uses_torch=True),
    Reader("`torch.load(mmap=True)` same file", open_torch_mmap, "pt", uses_torch=True),
    Reader("MosaicML streaming `LocalDataset` (MDS)", open_mds, "mds", uses_torch=True, anchor=True),
    Reader("litdata `StreamingDataset` (batch_decode=0)", open_litdata, "litdata", uses_torch=True,
           anchor=True),
)

# ------------------------------------------------------------------------------------------------
# 1. Random reads


def timed_pass(get: Getter, order: Sequence[int]) -> float:
    started = time.perf_counter()
    for i in order:
        get(i).sum()
    return time.perf_counter() - started


def bench_random_reads(
    readers: Sequence[Reader], plan: Plan, cache: Path, repeats: int
) -> list[dict[str, Any]]:
    order = plan.permutation()
    getters = {}
    for reader in readers:
        getters[reader.name] = reader.opener(cache)
        timed_pass(getters[reader.name], range(len(plan.rows)))  # sequential: every page mapped
    seconds: dict[str, list[float]] = {name: [] for name in getters}
    for _ in range(repeats):  # interleaved, so a noisy moment hits every reader alike
        for name, get in getters.items():
            seconds[name].append(timed_pass(get, order))
    rows = []
    for name, values in seconds.items():
        best = min(values)
        rows.append({"reader": name, "samples_s": len(order) / best, "gb_s": plan.num_bytes / best / 1e9,
                     "median_samples_s": len(order) / statistics.median(values)})
        print(f"  {name}: {rows[-1]['samples_s']:,.0f} samples/s", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# 2. Memory with 4 processes


def memory_child(reader: Reader, cache: Path, order: list[int], read_done: Any, measured: Any,
                 results: Any) -> None:
    """One of the 4 processes: read everything, wait for the others, measure, wait again."""
    if reader.uses_torch:
        import torch  # noqa: F401  (imported before the first measurement: not the reader's cost)
    before = psutil.Process().memory_full_info()
    get = reader.opener(cache)
    for i in order:
        get(i).sum()
    read_done.wait()  # all 4 have read the whole dataset and are alive
    after = psutil.Process().memory_full_info()
    results.put({"uss_before": before.uss, "uss": after.uss, "pss": after.pss,
                 "torch": "torch" in sys.modules})
    measured.wait()  # stay alive until every process has measured


def bench_memory(readers: Sequence[Reader], plan: Plan, cache: Path) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")  # fresh interpreters: nothing inherited from this process
    rows = []
    for k, reader in enumerate(readers):
        read_done, measured = ctx.Barrier(NUM_PROCESSES), ctx.Barrier(NUM_PROCESSES)
        results = ctx.Queue()
        orders = [np.random.default_rng([plan.seed, 3, k, p]).permutation(len(plan.rows)).tolist()
                  for p in range(NUM_PROCESSES)]
        procs = [ctx.Process(target=memory_child, args=(reader, cache, orders[p], read_done, measured,
                                                        results)) for p in range(NUM_PROCESSES)]
        for proc in procs:
            proc.start()
        got = [results.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
        rows.append({"reader": reader.name, "uss": [g["uss"] for g in got], "pss": [g["pss"] for g in got],
                     "uss_before": [g["uss_before"] for g in got], "torch": got[0]["torch"]})
        print(f"  {reader.name}: total PSS {sum(rows[-1]['pss']) / 2**20:,.0f} MiB", flush=True)
    return rows


# ------------------------------------------------------------------------------------------------
# 3. DataLoader end to end


class ListDataset:
    """What a user writes around ``torch.load(mmap=True)``: the list, indexed per sample."""

    def __init__(self, tensors: list[Any]) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, i: int) -> Any:
        return self.tensors[i]


def pad_collate(batch: list[Any]) -> dict[str, Any]:
    """The padding collate a user writes: same keys as the batched path's batch."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    lengths = torch.tensor([len(t) for t in batch])
    x = pad_sequence(batch, batch_first=True)
    return {"x": x, "x_lengths": lengths, "x_mask": torch.arange(x.shape[1])[None, :] < lengths[:, None]}


BASELINE = "`torch.load(mmap=True)` + per-sample fetch + pad collate"


def make_pipelines(plan: Plan, cache: Path, num_workers: int, default_threads: int) -> dict[str, Any]:
    """name -> (loader, torch intra-op threads in the main process while it runs)."""
    import torch
    from torch.utils.data import DataLoader

    ds = sharding.open_dataset(cache / "switchyard" / "ds")
    sampler = sharding.ShardedSampler(ds.shard_counts, world_size=1, rank=0, seed=plan.seed)
    tensors = torch.load(cache / "pt" / "list.pt", mmap=True)
    baseline = DataLoader(ListDataset(tensors), batch_size=BATCH_SIZE,  # type: ignore[arg-type]
                          sampler=plan.permutation(), collate_fn=pad_collate, num_workers=num_workers,
                          persistent_workers=num_workers > 0)
    pipelines = {
        "batched `make_loader`": (sharding.make_loader(ds, sampler, BATCH_SIZE, num_workers=num_workers), 1),
        "batched `make_loader`, group_by_length": (sharding.make_loader(
            ds, sampler, BATCH_SIZE, num_workers=num_workers, group_by_length=True), 1),
        BASELINE: (baseline, 1),
    }
    if num_workers == 0 and default_threads != 1:  # workers always run one thread each
        pipelines[f"{BASELINE}, torch's default {default_threads} threads"] = (baseline, default_threads)
    return pipelines


def timed_epoch(loader: Any) -> tuple[float, int, int]:
    """(seconds, samples, bytes of padded ``x`` produced) for one epoch."""
    started, count, padded = time.perf_counter(), 0, 0
    for batch in loader:
        batch["x"].view(-1)[::1024].sum()  # one float per 4 KiB page: the batch is really here
        count += len(batch["x"])
        padded += batch["x"].nbytes
    return time.perf_counter() - started, count, padded


def copy_bandwidth(threads: int, size: int = 256 << 20, repeats: int = 5) -> float:
    """The machine's ceiling for building batches: bytes read + written per second by numpy
    copies of ``size`` bytes between pre-faulted buffers, split over ``threads`` (numpy
    releases the GIL while copying); best of ``repeats``."""
    import threading

    src, dst = np.ones(size, np.uint8), np.zeros(size, np.uint8)
    chunk = size // threads
    best = math.inf
    for _ in range(repeats):
        workers = [threading.Thread(target=np.copyto, args=(dst[k * chunk:(k + 1) * chunk],
                                                             src[k * chunk:(k + 1) * chunk]))
                   for k in range(threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - started)
    return 2 * chunk * threads / best


def bench_dataloader(plan: Plan, cache: Path, repeats: int) -> tuple[list[dict[str, Any]], float]:
    """Each pipeline at 0 and 2 workers, with one intra-op thread as torchrun sets per rank
    (OMP_NUM_THREADS=1); the baseline at 0 workers also with torch's default thread count.
    Also the copy ceiling (``copy_bandwidth``, every core), measured before and after: the best."""
    import torch

    default_threads = torch.get_num_threads()
    ceiling = copy_bandwidth(os.cpu_count() or 1)
    rows = []
    for num_workers in WORKER_COUNTS:
        pipelines = make_pipelines(plan, cache, num_workers, default_threads)
        seconds: dict[str, list[float]] = {name: [] for name in pipelines}
        padded: dict[str, int] = {}
        for rep in range(repeats + 1):  # the first round warms up: workers start, files map
            for name, (loader, threads) in pipelines.items():  # interleaved: noise hits all alike
                torch.set_num_threads(threads)
                elapsed, count, padded[name] = timed_epoch(loader)
                if rep:
                    seconds[name].append(elapsed)
        torch.set_num_threads(default_threads)
        for name, values in seconds.items():
            # The least memory traffic an epoch needs: read every sample once, write the padded x.
            moved = plan.num_bytes + padded[name]
            rows.append({"pipeline": name, "workers": num_workers, "samples_s": count / min(values),
                         "median_samples_s": count / statistics.median(values),
                         "bytes_per_sample": moved / count, "gb_s": moved / min(values) / 1e9})
            print(f"  {name}, {num_workers} workers: {rows[-1]['samples_s']:,.0f} samples/s", flush=True)
        del pipelines
    ceiling = max(ceiling, copy_bandwidth(os.cpu_count() or 1))
    print(f"  copy ceiling: {ceiling / 1e9:.1f} GB/s read + written", flush=True)
    return rows, ceiling


# ------------------------------------------------------------------------------------------------
# Report


def mib(num_bytes: float) -> str:
    return f"{round(num_bytes / 2**20):,}"  # round() gives an int: never "-0"


def report_reads(rows: list[dict[str, Any]]) -> list[str]:
    base = rows[0]["samples_s"]
    lines = ["| reader | samples/s (best) | median | GB/s | x zero-copy |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['reader']} | {r['samples_s']:,.0f} | {r['median_samples_s']:,.0f} | "
                     f"{r['gb_s']:.2f} | {r['samples_s'] / base:.2f} |")
    return lines


def report_memory(rows: list[dict[str, Any]], dataset_bytes: int) -> list[str]:
    lines = [f"Dataset: {mib(dataset_bytes)} MiB. {NUM_PROCESSES} processes, each read every sample.", "",
             "| reader | imports torch | USS per process, MiB | PSS per process, MiB | "
             "USS growth from reading, MiB | sum USS, MiB | sum PSS, MiB | sum PSS / dataset |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        growth = [u - b for u, b in zip(r["uss"], r["uss_before"], strict=True)]
        lines.append(
            f"| {r['reader']} | {'yes' if r['torch'] else 'no'} | {mib(statistics.mean(r['uss']))} | "
            f"{mib(statistics.mean(r['pss']))} | {mib(statistics.mean(growth))} | {mib(sum(r['uss']))} | "
            f"{mib(sum(r['pss']))} | {sum(r['pss']) / dataset_bytes:.2f} |")
    return lines


def report_dataloader(rows: list[dict[str, Any]], ceiling: float) -> list[str]:
    baseline = best_of(rows, BASELINE)
    lines = ["| pipeline | workers | samples/s (best) | median | x baseline at its best "
             "| KB moved per sample | GB/s moved | of the copy ceiling |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['pipeline']} | {r['workers']} | {r['samples_s']:,.0f} | "
                     f"{r['median_samples_s']:,.0f} | {r['samples_s'] / baseline['samples_s']:.2f} | "
                     f"{r['bytes_per_sample'] / 1e3:.0f} | {r['gb_s']:.1f} | "
                     f"{r['gb_s'] * 1e9 / ceiling:.0%} |")
    lines += ["", f"Copy ceiling (numpy copies on all {os.cpu_count()} cores, bytes read + written): "
                  f"{ceiling / 1e9:.1f} GB/s. \"Moved\" is the least traffic a pipeline needs: every "
                  "sample read once plus the padded `x` written."]
    return lines


def best_of(rows: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    """The row of the pipeline starting with ``prefix`` at its best worker (and thread) count."""
    return max((r for r in rows if r["pipeline"].startswith(prefix)), key=lambda r: r["samples_s"])


def report_targets(reads: list[dict[str, Any]], memory: list[dict[str, Any]],
                   loader: list[dict[str, Any]], ceiling: float, dataset_bytes: int) -> list[str]:
    by_name = {r["reader"]: r["samples_s"] for r in reads}
    ours = by_name[READERS[1].name]
    lines = ["| target | measured | met |", "|---|---|---|"]

    def add(target: str, measured: str, met: bool) -> None:
        lines.append(f"| {target} | {measured} | {'yes' if met else 'no'} |")

    ratio = ours / by_name[READERS[0].name]
    add("random reads >= 0.8x zero-copy baseline", f"{ratio:.2f}x", ratio >= 0.8)
    for anchor in READERS[5:]:
        if anchor.name in by_name:
            r = ours / by_name[anchor.name]
            add(f"well ahead of {anchor.name.split(' `')[0]}", f"{r:.1f}x", r >= 2)
    baseline = best_of(loader, BASELINE)
    for prefix in ("batched `make_loader`", "batched `make_loader`, group_by_length"):
        best = max((r for r in loader if r["pipeline"] == prefix), key=lambda r: r["samples_s"])
        r = best["samples_s"] / baseline["samples_s"]
        needed = 2 * baseline["samples_s"] * best["bytes_per_sample"]  # bytes/s that 2x would move
        add(f"{prefix} >= 2x the mmap pipeline, each at its best worker count",
            f"{r:.2f}x ({best['samples_s']:,.0f} vs {baseline['samples_s']:,.0f} samples/s; "
            f"{best['workers']} vs {baseline['workers']} workers); 2x would move {needed / 1e9:.1f} GB/s, "
            f"{needed / ceiling:.0%} of the copy ceiling", r >= 2)
    mem = {r["reader"]: r for r in memory}
    if READERS[1].name in mem:
        pss = sum(mem[READERS[1].name]["pss"]) / dataset_bytes
        add(f"{NUM_PROCESSES}-process total PSS <= 1.2x dataset (Switchyard)", f"{pss:.2f}x", pss <= 1.2)
        growth = max(u - b for u, b in zip(mem[READERS[1].name]["uss"], mem[READERS[1].name]["uss_before"],
                                           strict=True))
        add("private memory per rank a small constant", f"max USS growth {mib(growth)} MiB "
            f"({growth / dataset_bytes:.1%} of the dataset)", growth < 0.05 * dataset_bytes)
    return lines


def environment(plan: Plan) -> list[str]:
    versions = {"python": platform.python_version()}
    for package in ("torch", "numpy", "mosaicml-streaming", "litdata"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[package] = importlib.metadata.version(package)
    return [f"- date: {datetime.date.today().isoformat()}",
            f"- machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM, {platform.system()} {platform.release()}",
            f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}",
            f"- data: {len(plan.rows):,} float32 samples of {MIN_ROWS}..{MAX_ROWS} x {COLUMNS}, "
            f"{plan.num_bytes / 1e9:.2f} GB, seed {plan.seed}",
            f"- command: `{' '.join([Path(sys.executable).name, *sys.argv])}`"]


# ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0, help="dataset size (default 1.0)")
    parser.add_argument("--quick", action="store_true", help="0.1 GB, 2 repeats: a smoke run")
    parser.add_argument("--skip-anchors", action="store_true",
                        help="leave out MosaicML streaming and litdata (when not installed)")
    parser.add_argument("--cache-dir", type=Path, default=Path("/tmp/switchyard-bench"))
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed passes per reader and epochs per pipeline (best kept; default 5)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("reads", "memory", "loader"), action="append",
                        help="run only these parts (repeatable); default: all")
    parser.add_argument("--markdown", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb, args.repeats = 0.1, 2
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    missing = anchors_available()
    if missing and not args.skip_anchors:
        sys.exit(f"{', '.join(missing)} not importable: run from the bench venv (see the top of "
                 f"{__file__}) or pass --skip-anchors")
    readers = [r for r in READERS if not (r.anchor and args.skip_anchors)]
    plan = Plan.of(args.size_gb, args.seed)
    cache = args.cache_dir / f"{args.size_gb:g}gb-seed{args.seed}"
    parts = set(args.only or ("reads", "memory", "loader"))
    print(f"data: {len(plan.rows):,} samples, {plan.num_bytes / 1e9:.2f} GB in {cache}", flush=True)
    ensure_formats(plan, cache, sorted({r.needs for r in readers} | {"switchyard", "pt"}))
    out = ["## Environment", "", *environment(plan), ""]
    if args.skip_anchors:
        out += ["MosaicML streaming and litdata: skipped (--skip-anchors).", ""]
    reads = memory = loader = []
    ceiling = 0.0
    if "reads" in parts:
        print("random reads", flush=True)
        recache(cache, sorted({r.needs for r in readers}))
        reads = bench_random_reads(readers, plan, cache, args.repeats)
        out += ["## Random per-sample reads (page cache warm)", "", *report_reads(reads), ""]
    if "memory" in parts:
        print("memory, 4 processes", flush=True)
        recache(cache, ["pt", "raw", "switchyard"])
        memory = bench_memory([READERS[0], READERS[1], READERS[3], READERS[4]], plan, cache)
        out += ["## Memory, 4 processes reading the whole dataset", "",
                *report_memory(memory, plan.num_bytes), ""]
    if "loader" in parts:
        print("DataLoader end to end", flush=True)
        recache(cache, ["pt", "switchyard"])
        loader, ceiling = bench_dataloader(plan, cache, args.repeats)
        out += ["## DataLoader end to end (batches of 64 padded samples)", "",
                *report_dataloader(loader, ceiling), ""]
    if reads and memory and loader:
        out += ["## Targets", "", *report_targets(reads, memory, loader, ceiling, plan.num_bytes), ""]
    text = "\n".join(out)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)


if __name__ == "__main__":
    main()
