"""`switchyard status` and `show` on 10,000-job sweeps: finished, running and failed.

Each sweep is built through the real :class:`Registry` API (create, add jobs, claim, confirm,
observe), with the files a run leaves behind: the task's status report, ``metrics.jsonl``, and
``summary.json`` (finished jobs) or the telemetry samples (failed and running jobs, which wrote no
summary). SLURM ids are array tasks no cluster knows (arrays of 1001, the local cluster's
``MaxArraySize``), so the real ``sacct`` answers quickly and reports nothing.

- finished: every job COMPLETED, with summary.json.
- failed: every job FAILED after sampling telemetry for 5 minutes (60 samples), no summary.json;
  rank 0 summarised the telemetry as the run failed (``telemetry/end-summary.json``).
- running a day: the same as running, each running job having sampled for a day (17,280
  samples, 4.5 MB, 1.1 GB over the 256 jobs) with the fold its sampler keeps beside them
  (``telemetry.fold``): no call reads the raw samples.
- killed: every job FAILED, killed outright (OOM killer, node failure): no end summary, so the
  first status after they ended reads the memory section each job's sampler kept with its fold
  (once: the result is kept); ``bench/status_first_call.py`` compares that call with a revision's.
- running: one array in flight at ``array_parallelism`` 256: 256 jobs RUNNING (telemetry so far),
  3,744 COMPLETED, 6,000 queued.

Timed: the command as a user runs it (a new ``python -m orchestrator.cli`` process, output piped),
the first call after the jobs ended (which does what is done once per ended job) and the median of
the 5 calls after it; on the day-long sweep also ``plot`` of a running job (its series; ``--raw``
for comparison, no target) and ``logs`` of it (a day of log lines).
Also, in-process, reconciliation's matching of 10,000 array tasks against a
full ``sacct`` reply (sacct itself replaced by its answer).

    .venv/bin/python bench/scale_sweeps.py                   # this checkout
    .venv/bin/python bench/scale_sweeps.py --before dc39507  # and that commit, side by side

``bench/scale_bench.py`` imports :func:`rows`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.registry.db import Job, Observation, Registry, Submitted  # noqa: E402 -- after the path is set
from orchestrator.registry.status_file import TaskStatus  # noqa: E402

NUM_JOBS = 10_000
ARRAY_SIZE = 1001  # the local cluster's MaxArraySize
ARRAY_PARALLELISM = 256
NUM_DONE_WHILE_RUNNING = 3_744
REPEATS = 5
TELEMETRY_SAMPLES = 60  # 5 minutes at the default 5 s interval
STATUS_TARGET_S, SHOW_TARGET_S = 1.0, 0.3
FIRST_CALL_TARGET_S = 2.0  # every command's first call, too (issue 39)
PLOT_TARGET_S = 2.0
KINDS = ("finished", "running", "running a day", "failed", "killed")
DAY_SAMPLES = 17_280  # "running a day": each running job has sampled for a day at 5 s
STATES = {"finished": "COMPLETED", "failed": "FAILED", "killed": "FAILED"}
# What resources_for() records for a jobs.train point on SLURM: decoded with every job row.
RESOURCES = {"executor": "slurm", "max_requeues": 3, "array_parallelism": ARRAY_PARALLELISM,
             "source": "cluster",
             "params": {"job_name": "train", "partition": "debug", "time": 60, "nodes": 1,
                        "ntasks_per_node": 2, "cpus_per_task": 1, "mem": "4G", "signal_delay_s": 120,
                        "setup": ["export OMP_NUM_THREADS=1"], "srun_args": ["--kill-on-bad-exit=1"],
                        "additional_parameters": {"requeue": True, "open_mode": "append"}}}


def _metrics_text(steps: int = 200, every: int = 10) -> str:
    lines = [json.dumps({"step": s, "train_loss": 1.0 / s, "samples_per_s": 5000.0, "lr": 1e-3,
                         "grad_norm": 0.5, "peak_mem_bytes": 440553472})
             for s in range(every, steps + 1, every)]
    return "\n".join(lines) + "\n"


def _telemetry_lines(start: float, samples: int = TELEMETRY_SAMPLES) -> str:
    lines = []
    for i in range(samples):
        ranks = [{"rank": r, "pid": 1000 + r, "rss_bytes": 400_000_000 + 1000 * i, "shared_bytes": 9_000_000,
                  "uss_bytes": 300_000_000 if i % 6 == 0 else None} for r in range(2)]
        lines.append(json.dumps({"t": start + 5 * i, "node": "n1", "ranks": ranks, "sample_s": 0.0001}))
    return "\n".join(lines) + "\n"


def _write_telemetry(run_dir: Path, start: float, text: str | None = None) -> None:
    tel = run_dir / "telemetry"
    (tel / "ranks").mkdir(parents=True)
    (tel / "n1.jsonl").write_text(text or _telemetry_lines(start))
    for r in range(2):
        (tel / "ranks" / f"rank-{r}.json").write_text(json.dumps(
            {"rank": r, "local_rank": r, "node": "n1", "pid": 1000 + r, "device": None,
             "cuda_visible_devices": None}))


def _copy_telemetry(template: Path, run_dir: Path) -> None:
    """The template's telemetry: its samples, the ranks' files and the fold its sampler kept."""
    shutil.copytree(template / "telemetry", run_dir / "telemetry")


def _summary(memory: dict[str, Any]) -> str:
    return json.dumps({"world_size": 2, "steps": 200, "samples_per_rank": [6400, 6400],
                       "final_train_loss": 0.026, "wall_s": 2.4, "memory": memory})


def build(root: Path, kind: str, num_jobs: int = NUM_JOBS) -> tuple[Path, int, int]:
    """A registry holding one ``kind`` sweep of ``num_jobs`` jobs: (its path, sweep id, a job to show)."""
    from orchestrator.telemetry.files import write_end_summary
    from orchestrator.telemetry.summary import sampler_fold, summarize

    metrics, now = _metrics_text(), time.time()
    day = _telemetry_lines(now - 86_400, DAY_SAMPLES) if kind == "running a day" else None
    template = root / ("template day" if day else "template")
    if not template.exists():  # the samples, and the fold their sampler wrote as it took them
        _write_telemetry(template, now - 310, day)
        sampler_fold(template, template / "telemetry" / "n1.jsonl").write()
    memory = summarize(template)
    path, sweep_dir = root / f"{kind}.db", root / kind
    running = range(NUM_DONE_WHILE_RUNNING, NUM_DONE_WHILE_RUNNING + ARRAY_PARALLELISM)
    with Registry(path) as reg:
        sweep_id = reg.create_sweep("train", "optim.lr=... seed=...", str(sweep_dir), "slurm", "entry.pkl")
        reg.add_jobs(Job(sweep_id, n, [f"optim.lr={n}", f"seed={n % 7}", "model=mlp"],
                         str(sweep_dir / str(n)), RESOURCES, 200) for n in range(num_jobs))
        claims = reg.claim(sweep_id, range(num_jobs))
        ids = {n: (str(900_000 + n // ARRAY_SIZE), n % ARRAY_SIZE) for n in range(num_jobs)}
        reg.confirm(Submitted(claims[n], f"{a}_{i}", a, i, str(sweep_dir / ".submitit" / f"{a}_{i}"))
                    for n, (a, i) in ids.items())
        observations = []
        for n in range(num_jobs):
            state = STATES.get(kind) if not kind.startswith("running") else \
                "COMPLETED" if n < NUM_DONE_WHILE_RUNNING else "RUNNING" if n in running else None
            if state is None:
                continue  # queued: nothing written yet
            run_dir, job_id = sweep_dir / str(n), f"{ids[n][0]}_{ids[n][1]}"
            run_dir.mkdir(parents=True)
            (run_dir / "metrics.jsonl").write_text(metrics)
            ended = None if state == "RUNNING" else now - 10
            code = {"COMPLETED": 0, "FAILED": 1}.get(state)
            error = "RuntimeError: CUDA error: an illegal memory access" if state == "FAILED" else None
            TaskStatus(job_id, started_at=now - 310, node="n1", ended_at=ended, exit_code=code,
                       error=error).write(run_dir)
            if state == "COMPLETED":
                (run_dir / "summary.json").write_text(_summary(memory))
            else:
                _copy_telemetry(template, run_dir)
            if kind == "failed":  # what rank 0 of a failing run leaves (the trainer's keep_end_summary)
                write_end_summary(run_dir, summarize(run_dir))
            observations.append(Observation(claims[n], state, started_at=now - 310, ended_at=ended,
                                            exit_code=code, node="n1", error=error))
        reg.observe(observations)
    show = running[0] if kind.startswith("running") else num_jobs // 2
    if day:  # a day of log lines for `logs`
        log_dir = sweep_dir / ".submitit" / f"{ids[show][0]}_{ids[show][1]}"
        log_dir.mkdir(parents=True)
        line = "step 120 | loss 0.0263 | 5012 samples/s | lr 1.0e-03 | grad_norm 0.51 | peak 0.41 GiB\n"
        (log_dir / f"{ids[show][0]}_{ids[show][1]}_0_log.out").write_text(line * DAY_SAMPLES)
        (log_dir / f"{ids[show][0]}_{ids[show][1]}_0_log.err").write_text("")
    return path, sweep_id, show


def _time_command(src: Path, args: list[str]) -> tuple[float, str]:
    """(seconds, what it printed)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "orchestrator.cli", *args], cwd=src,
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "PYTHONPATH": str(src)})
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed in {src}: {proc.stderr[-2000:]}")
    return elapsed, proc.stdout


def time_command(src: Path, args: list[str]) -> tuple[float, float]:
    """(the first call, the median of the next REPEATS)."""
    first, _ = _time_command(src, args)
    return first, statistics.median(_time_command(src, args)[0] for _ in range(REPEATS))


def _unread(text: str) -> int:
    """How many ended jobs a status call left unread (its footer), 0 when none."""
    match = re.search(r"^(\d+) ended jobs? not read yet", text, re.MULTILINE)
    return int(match.group(1)) if match else 0


def time_status(src: Path, args: list[str]) -> tuple[float, float, str]:
    """As :func:`time_command`, and how many ended jobs the first call left unread (each call reads
    for about a second and the next reads on), and after how many calls none was."""
    first, text = _time_command(src, args)
    times, left = [], [_unread(text)]
    for _ in range(REPEATS):
        elapsed, text = _time_command(src, args)
        times.append(elapsed)
        left.append(_unread(text))
    if not left[0]:
        return first, statistics.median(times), ""
    done = next((i + 1 for i, n in enumerate(left) if n == 0), None)
    calls = f"all read by call {done}" if done else f"{left[-1]:,} still unread after {len(left)} calls"
    return first, statistics.median(times), f"; the first left {left[0]:,} unread, {calls}"


def time_matching(num_tasks: int = NUM_JOBS) -> float:
    """Reconciliation's matching of every pending task against a full sacct reply, in-process."""
    from orchestrator.launch import slurm_query
    from orchestrator.registry import db, reconciliation

    reply = {f"{900_000 + n // ARRAY_SIZE}_{n % ARRAY_SIZE}": "PENDING" for n in range(num_tasks)}
    attempts = [db.Attempt(n, 1, n, 1, task, task.split("_")[0], n % ARRAY_SIZE, "SUBMITTED", 0,
                                 time.time(), None, None, None, None, None, None, time.time())
                for n, task in enumerate(reply)]
    original: Callable[..., Any] = slurm_query._from_sacct
    slurm_query._from_sacct = lambda ids, timeout_s: reply
    try:
        start = time.perf_counter()
        reconciliation._slurm_reports(attempts, time.time(), slurm_query.query_states)
        return time.perf_counter() - start
    finally:
        slurm_query._from_sacct = original


def measure(src: Path, label: str = "", kinds: tuple[str, ...] = KINDS,
            num_jobs: int = NUM_JOBS) -> list[tuple[str, str, str]]:
    out = []
    suffix = f" [{label}]" if label else ""
    jobs = f"{num_jobs:,} jobs"
    first_target = f"first call < {FIRST_CALL_TARGET_S:g} s"
    with tempfile.TemporaryDirectory(prefix="scale-sweeps-") as tmp:
        for kind in kinds:
            path, sweep_id, show = build(Path(tmp), kind, num_jobs)
            fresh = path.with_name(f"{kind} fresh.db")  # as built: nothing read yet, for --read-all
            shutil.copy(path, fresh)
            first, median, read = time_status(src, ["status", str(sweep_id), "--registry", str(path)])
            out.append((f"switchyard status, {jobs} {kind}{suffix}",
                        f"{median:.2f} s (first call {first:.2f} s{read})",
                        f"< {STATUS_TARGET_S:g} s, {first_target}"))
            if read:  # what the first call would have cost had it read every ended job
                elapsed, _ = _time_command(src, ["status", str(sweep_id), "--registry", str(fresh),
                                                 "--read-all"])
                out.append((f"switchyard status --read-all, first call, {jobs} {kind}{suffix}",
                            f"{elapsed:.2f} s", "- (reads every ended job at once)"))
            first, median = time_command(src, ["show", f"{sweep_id}/{show}", "--registry", str(path)])
            out.append((f"switchyard show ID/N, {jobs} {kind}{suffix}",
                        f"{median:.2f} s (first call {first:.2f} s)",
                        f"< {SHOW_TARGET_S:g} s, {first_target}"))
            if kind == "running a day":
                run_dir = Path(tmp) / kind / str(show)
                png = Path(tmp) / "memory.png"
                first, median = time_command(src, ["logs", f"{sweep_id}/{show}", "--registry", str(path)])
                out.append((f"switchyard logs ID/N, a day of log lines{suffix}",
                            f"{median:.2f} s (first call {first:.2f} s)", first_target))
                first, median = time_command(src, ["plot", str(run_dir), "--out", str(png)])
                out.append((f"switchyard plot RUN, a day of samples{suffix}",
                            f"{median:.2f} s (first call {first:.2f} s)", f"< {PLOT_TARGET_S:g} s"))
                first, median = time_command(src, ["plot", str(run_dir), "--out", str(png), "--raw"])
                out.append((f"switchyard plot --raw RUN, a day of samples{suffix}",
                            f"{median:.2f} s (first call {first:.2f} s)", "- (reads every sample)"))
            shutil.rmtree(Path(tmp) / kind)
    return out


def rows(before: str | None = None, kinds: tuple[str, ...] = KINDS,
         num_jobs: int = NUM_JOBS) -> list[tuple[str, str, str]]:
    """(figure, measured, target) for this checkout; with ``before`` (a git revision) that
    revision's figures too, measured the same way from a temporary worktree."""
    result = measure(REPO, kinds=kinds, num_jobs=num_jobs)
    result.append(("status: SLURM matching, 10,000 pending tasks, full sacct reply (in-process)",
                   f"{time_matching():.3f} s", "linear (was 14 s)"))
    if before:
        worktree = Path(tempfile.mkdtemp(prefix="scale-sweeps-before-"))
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), before],
                       check=True, capture_output=True)
        try:
            result += measure(worktree, f"before, {before}", kinds, num_jobs)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)],
                           check=False, capture_output=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default=None, help="also measure this git revision (e.g. dc39507)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated sweeps to build (default all: {','.join(KINDS)})")
    args = parser.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(","))
    if unknown := [k for k in kinds if k not in KINDS]:
        parser.error(f"--kinds {','.join(unknown)} is invalid: choose from {','.join(KINDS)}")
    print("| figure | measured | target |\n|---|---|---|")
    for figure, measured, target in rows(args.before, kinds):
        print(f"| {figure} | {measured} | {target} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
