"""``switchyard status | logs | show | cancel | resubmit``: the sweep registry, reconciled, for people
(a table; colours on a terminal, plain when piped) and for scripts (``--json``).

Every command first reconciles what it is about with SLURM (one batched call) and the tasks'
status files, so what it prints is current. Importing this module stays cheap: no Hydra, submitit
or torch unless a command submits.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

from orchestrator.entry import shown
from orchestrator.export import record as exports
from orchestrator.launch import hang_dumps, local_jobs, provenance, slurm_query
from orchestrator.launch.bad_nodes import STRAGGLERS_FILE
from orchestrator.launch.cancel import SLURM_END_WAIT_S, CancelError, cancel
from orchestrator.registry.db import (
    Attempt,
    Job,
    Registry,
    RegistryError,
    Result,
    Sweep,
    default_path,
    is_single,
)
from orchestrator.registry.reconciliation import Reconciled, reconcile
from orchestrator.registry.states import RETRY_STATES, TERMINAL_STATES
from orchestrator.sweeps.results import JobRow, job_rows
from orchestrator.telemetry.summary import format_summary

STATE_COLOURS = {"COMPLETED": "32", "RUNNING": "36", "COMPLETING": "36", "CONFIGURING": "36",
                 "PENDING": "33", "SUBMITTED": "33", "SUBMITTING": "33", "REQUEUED": "33",
                 "CANCELLED": "35"}  # everything else that ended badly: red (31)




class CommandError(RuntimeError):
    """A command cannot do what it was asked; the message says what to run instead."""


# ------------------------------------------------------------------------------------------------
# Naming things: SWEEP, SWEEP/NUM, or a SLURM id


@dataclass(frozen=True)
class Ref:
    sweep_id: int
    num: int | None = None  # None: the whole sweep

    def __str__(self) -> str:
        return str(self.sweep_id) if self.num is None else f"{self.sweep_id}/{self.num}"


# The largest id SQLite stores: a larger number names nothing (and SQLite cannot even look it up).
MAX_ID = 2**63 - 1


def ascii_digits(text: str, what: str) -> None:
    """Ids and numbers are written in ASCII digits: Python's ``int`` and ``\\d`` also take
    fullwidth (``１``) and Arabic-Indic (``١``) ones, and ``status １`` showed sweep 1."""
    if any(c.isdigit() and not c.isascii() for c in text):
        fixed = "".join(str(unicodedata.digit(c)) if c.isdigit() else c for c in text)
        raise CommandError(f"{what} {shown(text)} is invalid: write it in the digits 0-9 "
                           f"(try {shown(fixed)})")


def parse_ref(registry: Registry, text: str, want_job: bool = False) -> Ref:
    """``12`` (a sweep), ``12/3`` (its job 3), or a SLURM id (``4711_3``, ``4711``, a local pid).
    The sweep and the job must exist: a job number past the sweep's end once read as a job with
    nothing to show (an empty table, "every job has already ended")."""
    ascii_digits(text, "the id")
    match = re.fullmatch(r"([0-9]+)(?:[/:]([0-9]+))?", text.strip())
    numbers = [int(n) for n in match.groups() if n is not None] if match else []
    if numbers and max(numbers) <= MAX_ID:
        if len(numbers) == 2:
            return _existing_job(registry, numbers[0], numbers[1])
        if not want_job and any(s.id == numbers[0] for s in registry.sweeps()):
            return Ref(numbers[0])
    attempt = registry.find_attempt(text.strip())
    if attempt is not None:
        return Ref(attempt.sweep_id, attempt.num)
    what = "a job: SWEEP/NUM (e.g. 3/0) or its SLURM id" if want_job else \
        "a sweep id, SWEEP/NUM, or a SLURM job id"
    raise CommandError(f"{shown(text)} names nothing in {registry.path}: expected {what} "
                       f"({command(registry, 'status')} lists them)")


def _existing_job(registry: Registry, sweep_id: int, num: int) -> Ref:
    registry.sweep(sweep_id)  # raises, naming the latest sweeps, when there is none
    count = registry.count_jobs(sweep_id)
    if num >= count:
        jobs = (f"{sweep_id}/0 to {sweep_id}/{count - 1}" if count > 1
                else f"{sweep_id}/0" if count else "none")
        raise CommandError(f"sweep {sweep_id} has no job {num}: it has {count} job"
                           f"{'s' if count != 1 else ''} ({jobs}; {command(registry, 'status', sweep_id)} "
                           f"lists them)")
    registry.job(sweep_id, num)  # numbered from 0 without gaps; raises if one is missing anyway
    return Ref(sweep_id, num)


def _job_ref(registry: Registry, text: str) -> Ref:
    ref = parse_ref(registry, text, want_job=True)
    if ref.num is None:
        raise CommandError(f"{text!r} is a sweep; name one of its jobs, e.g. {text}/0")
    registry.job(ref.sweep_id, ref.num)  # raises with the fix when it does not exist
    return ref


def command(registry: Registry, *args: object) -> str:
    """The switchyard command line to run next, with --registry when it is not the default one."""
    where = [] if registry.path == default_path() else ["--registry", str(registry.path)]
    return " ".join(["switchyard", *map(str, args), *where])


# ------------------------------------------------------------------------------------------------
# Rows: what status shows per job (read and kept by orchestrator.sweeps.results)


def peak_memory_text(result: Result) -> str:
    if result.peak_bytes is None:
        return "-"
    flags = len(result.flags)
    return f"{result.peak_bytes / 2**30:.2f} GiB" + (f" !{flags}" if flags else "")


# ------------------------------------------------------------------------------------------------
# Tables


def colour_enabled(stream: IO[str]) -> bool:
    """Colours on a terminal only; NO_COLOR (https://no-color.org) turns them off."""
    return stream.isatty() and not os.environ.get("NO_COLOR")


def paint(state: str, enabled: bool) -> Callable[[str], str]:
    code = STATE_COLOURS.get(state, "31" if state in TERMINAL_STATES else "0")
    return (lambda text: f"\033[{code}m{text}\033[0m") if enabled and code != "0" else (lambda t: t)


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 painters: Sequence[dict[int, Callable[[str], str]]] | None = None) -> str:
    """Left-aligned columns two spaces apart; painters colour cells after padding (ANSI codes
    would otherwise count towards the width)."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    for n, row in enumerate(rows):
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=True)]
        for i, painter in (painters[n] if painters else {}).items():
            cells[i] = painter(cells[i])
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _progress(row: JobRow) -> str:
    if row.step is None:
        return "-"
    return f"{row.step}/{row.job.total_steps}" if row.job.total_steps else str(row.step)


def varying(jobs: Sequence[Job]) -> dict[int, list[str]]:
    """Each job's overrides minus those every job of the sweep shares (the command line shows them)."""
    shared = set.intersection(*(set(j.overrides) for j in jobs)) if len(jobs) > 1 else set()
    return {j.num: [o for o in j.overrides if o not in shared] for j in jobs}


def jobs_table(rows: Sequence[JobRow], colour: bool, now: float, executor: str = "slurm",
               sweep_jobs: Sequence[Job] | None = None) -> str:
    """``sweep_jobs``: every job of the sweep, when ``rows`` are some of them (the overrides they
    all share are left out)."""
    headers = ["JOB", "STATE", "TRY", "REQUEUES", "SLURM_ID" if executor == "slurm" else "PID", "NODE",
               "STEP", "LOSS", "PEAK MEM", "RUNTIME", "OVERRIDES"]
    overrides = varying(sweep_jobs or [r.job for r in rows])
    cells, painters = [], []
    for r in rows:
        a = r.attempt
        state = a.state if a else "-"
        cells.append([r.job.ref, state, str(a.attempt) if a else "0", str(a.requeues) if a else "0",
                      (a.slurm_id or "-") if a else "-", (a.node or "-") if a else "-",
                      _progress(r), f"{r.loss:.4f}" if r.loss is not None else "-",
                      peak_memory_text(r.result), format_duration(r.runtime_s(now)),
                      " ".join(overrides[r.job.num]) or "-"])
        if colour:
            painters.append({1: paint(state, colour)})
    return render_table(headers, cells, painters or None)


def sweep_summary(registry: Registry, sweep: Sweep, rows: Sequence[JobRow] | None = None
                  ) -> dict[str, Any]:
    """The sweep's counts; from ``rows`` when the caller has read them already."""
    if rows is None:
        latest = list(registry.latest_attempts(sweep.id).values())
        num_jobs = registry.count_jobs(sweep.id)
    else:
        latest, num_jobs = [r.attempt for r in rows if r.attempt], len(rows)
    states = Counter(a.state for a in latest)
    return {"id": sweep.id, "created_at": sweep.created_at, "app": sweep.app, "command": sweep.command,
            "sweep_dir": sweep.sweep_dir, "executor": sweep.executor,
            "jobs": num_jobs, "states": dict(sorted(states.items()))}


def sweeps_table(summaries: Sequence[dict[str, Any]], colour: bool) -> str:
    headers = ["SWEEP", "CREATED", "APP", "EXECUTOR", "JOBS", "DONE", "ACTIVE", "FAILED", "CANCELLED",
               "COMMAND"]
    cells, painters = [], []
    for s in summaries:
        states: dict[str, int] = s["states"]
        # a search's PRUNED trial was stopped by its pruner: counted with the cancelled, not active
        done, cancelled = states.get("COMPLETED", 0), states.get("CANCELLED", 0) + states.get("PRUNED", 0)
        # a cancelled job was stopped by someone, not broken: counting it as failed sends the
        # user looking for an error that is not there
        failed = sum(n for k, n in states.items() if k in RETRY_STATES and k != "CANCELLED")
        active = sum(states.values()) - done - failed - cancelled
        cells.append([str(s["id"]), format_time(s["created_at"]), s["app"], s["executor"],
                      str(s["jobs"]), str(done), str(active), str(failed), str(cancelled),
                      s["command"] or "-"])
        state = "FAILED" if failed else "RUNNING" if active else "CANCELLED" if cancelled else "COMPLETED"
        painters.append({0: paint(state, colour)})
    return render_table(headers, cells, painters)


# ------------------------------------------------------------------------------------------------
# Commands (each returns the process exit status)


def print_warnings(reconciled: Reconciled, out: IO[str]) -> None:
    for warning in reconciled.warnings:
        print(f"warning: {warning}", file=out)


def cmd_status(registry: Registry, target: str | None, as_json: bool, out: IO[str] = sys.stdout) -> int:
    """The sweeps, or one sweep's jobs, every row whole (``results.job_rows``)."""
    if target is None:
        reconciled = reconcile(registry, ask_slurm=slurm_query.query_states)
        summaries = [sweep_summary(registry, s) for s in registry.sweeps()]
        if as_json:
            print(json.dumps({"registry": str(registry.path), "sweeps": summaries,
                              "warnings": reconciled.warnings}, indent=1), file=out)
            return 0
        print_warnings(reconciled, out)
        if not summaries:
            print(f"no sweeps recorded in {registry.path} yet", file=out)
        else:
            print(sweeps_table(summaries, colour_enabled(out)), file=out)
        return 0
    ref = parse_ref(registry, target)
    reconciled = reconcile(registry, [ref.sweep_id], ask_slurm=slurm_query.query_states)
    sweep, now = registry.sweep(ref.sweep_id), time.time()
    if ref.num is None:
        rows = job_rows(registry, ref.sweep_id)
        summary, sweep_jobs = sweep_summary(registry, sweep, rows), None
    else:  # that job's files only
        rows = job_rows(registry, ref.sweep_id, ref.num)
        summary, sweep_jobs = sweep_summary(registry, sweep), registry.jobs(ref.sweep_id, resources=False)
    if as_json:
        print(json.dumps({"sweep": summary, "jobs": [r.as_json(now) for r in rows],
                          "warnings": reconciled.warnings}, indent=1), file=out)
        return 0
    counts = ", ".join(f"{n} {state.lower()}" for state, n in summary["states"].items())
    print(f"sweep {sweep.id}  {sweep.app}  {format_time(sweep.created_at)}  {sweep.executor}  "
          f"{summary['jobs']} jobs: {counts or 'none submitted'}\n"
          f"dir: {sweep.sweep_dir}\ncommand: {sweep.command or '-'}", file=out)
    print_warnings(reconciled, out)
    print(file=out)
    print(jobs_table(rows, colour_enabled(out), now, sweep.executor, sweep_jobs), file=out)
    flags = [f"  {r.job.ref}: ! {flag}" for r in rows for flag in r.result.flags]
    if flags:  # idle GPUs, GPU 0 overload, a rank on another rank's GPU: worth a line each
        print("\nmemory warnings:\n" + "\n".join(flags), file=out)
    return 0


def num_ranks(job: Job) -> int | None:
    """How many ranks the job runs, from the executor parameters it was submitted with (SLURM's
    ``ntasks_per_node``, the local executor's ``tasks_per_node``); None for a job recorded without."""
    params = job.resources.get("params") or {}
    per_node = params.get("ntasks_per_node", params.get("tasks_per_node"))
    if not isinstance(per_node, int) or not isinstance(params.get("nodes"), int):
        return None
    return int(params["nodes"]) * per_node


def check_rank(job: Job, rank: int) -> None:
    """A rank the job does not have would read as a log "not written yet", and waiting never helps."""
    ranks = num_ranks(job)
    if rank < 0 or (ranks is not None and rank >= ranks):
        has = (f"has {ranks} rank{'s' if ranks != 1 else ''} (0..{ranks - 1})" if ranks
               else "numbers its ranks from 0")
        raise CommandError(f"--rank {rank} is invalid: job {job.ref} {has} (try --rank 0)")


def log_paths(attempt: Attempt, rank: int) -> tuple[Path, Path]:
    """submitit's per-rank logs: LOGDIR/JOBID_RANK_log.out and .err."""
    if not attempt.log_dir or not attempt.slurm_id:
        raise CommandError(f"attempt {attempt.attempt} of job {attempt.sweep_id}/{attempt.num} has no "
                           f"logs: it was never submitted ({attempt.state})")
    base = Path(attempt.log_dir) / f"{attempt.slurm_id}_{rank}_log"
    return base.with_suffix(".out"), base.with_suffix(".err")


def _attempt(registry: Registry, ref: Ref, number: int | None) -> Attempt:
    attempts = registry.attempts(ref.sweep_id, ref.num)
    if not attempts:
        raise CommandError(f"job {ref} was never submitted")
    if number is None:
        return attempts[-1]
    for a in attempts:
        if a.attempt == number:
            return a
    raise CommandError(f"job {ref} has attempts {[a.attempt for a in attempts]}, not {number}")


def cmd_logs(registry: Registry, target: str, rank: int, follow: bool, stream: str,
             attempt_number: int | None = None, out: IO[str] = sys.stdout) -> int:
    ref = _job_ref(registry, target)
    print_warnings(reconcile(registry, [ref.sweep_id], [cast(int, ref.num)],
                             ask_slurm=slurm_query.query_states), sys.stderr)
    check_rank(registry.job(ref.sweep_id, cast(int, ref.num)), rank)
    attempt = _attempt(registry, ref, attempt_number)
    stdout_path, stderr_path = log_paths(attempt, rank)
    paths = {"out": [stdout_path], "err": [stderr_path], "both": [stdout_path, stderr_path]}[stream]
    if not follow:
        for path in paths:
            if len(paths) > 1:
                print(f"==> {path} <==", file=out)
            print(_read(path) or f"(empty: {'not written yet' if not path.exists() else 'no output'})",
                  file=out)
        return 0
    return _follow(registry, ref, attempt, paths, out)


def _read(path: Path, offset: int = 0) -> str:
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _follow(registry: Registry, ref: Ref, attempt: Attempt, paths: list[Path], out: IO[str],
            poll_s: float = 0.5) -> int:
    """Print what is appended to the logs until the attempt has ended (Ctrl-C stops it sooner)."""
    offsets = dict.fromkeys(paths, 0)
    current: Path | None = None
    last_check, ended = 0.0, False
    try:
        while True:
            for path in paths:
                text = _read(path, offsets[path])
                if text:
                    if len(paths) > 1 and path != current:
                        print(f"==> {path} <==", file=out)
                        current = path
                    out.write(text)
                    out.flush()
                    offsets[path] += len(text.encode(errors="replace"))
            if ended:
                return 0
            if time.monotonic() - last_check > 2:
                reconcile(registry, [ref.sweep_id], [cast(int, ref.num)], ask_slurm=slurm_query.query_states)
                state = _attempt(registry, ref, attempt.attempt).state
                ended, last_check = state in TERMINAL_STATES, time.monotonic()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return 0


def cmd_show(registry: Registry, target: str, as_json: bool, out: IO[str] = sys.stdout) -> int:
    ref = _job_ref(registry, target)
    assert ref.num is not None  # _job_ref guarantees it; narrows the type
    # this job only, not its sweep
    reconciled = reconcile(registry, [ref.sweep_id], [ref.num], ask_slurm=slurm_query.query_states)
    (row,) = job_rows(registry, ref.sweep_id, ref.num)
    job, sweep = row.job, registry.sweep(ref.sweep_id)
    attempts = registry.attempts(ref.sweep_id, ref.num)
    cause = failure_cause(job, attempts[-1], sweep.executor) if attempts else None
    avoided = registry.exclusions(ref.sweep_id, ref.num)  # the nodes a retry was kept off, and why
    config_path = Path(job.run_dir) / ".switchyard" / "config.yaml"
    config_text = _read(config_path) or f"(missing: {config_path})\n"
    memory = row.memory
    # What it ran: code snapshot, git, config hash, versions; kept in the registry at submission
    # (a registry from before that: its run directory's provenance.json)
    origin = registry.provenance(ref.sweep_id, ref.num) or provenance.read(job.run_dir)
    resumed = provenance.resumed_from(job.run_dir)
    hang = hang_dumps.recorded(Path(job.run_dir))  # where each rank was when a collective hung
    slow = _read_json_list(Path(job.run_dir) / STRAGGLERS_FILE)  # ranks flagged as persistently late
    exported = exports.recorded(Path(job.run_dir))  # switchyard export, checkpoint.export
    if as_json:
        print(json.dumps({"job": job.ref, "app": sweep.app, "overrides": job.overrides,
                          "run_dir": job.run_dir, "resources": job.resources, "provenance": origin,
                          "config_path": str(config_path), "config": config_text,
                          "attempts": [a.__dict__ for a in attempts],
                          "avoided_nodes": {a.attempt: avoided[a.id] for a in attempts if a.id in avoided},
                          "memory": memory, "warnings": reconciled.warnings, "failure": cause,
                          "resumed_from": resumed, "hang": hang, "stragglers": slow,
                          "exports": exported},
                         indent=1), file=out)
        return 0
    colour = colour_enabled(out)
    print(f"job {job.ref}  sweep {sweep.id} ({sweep.app})\noverrides: {' '.join(job.overrides) or '-'}\n"
          f"run dir: {job.run_dir}", file=out)
    if origin is not None:
        print("\n".join(provenance.lines(origin)), file=out)
    if resumed is not None:  # what it continued from, and the config changes applied
        print("\n".join(provenance.resume_lines(resumed)), file=out)
    for line in exports.show_lines(exported):
        print(line, file=out)
    print_warnings(reconciled, out)
    cells = [[str(a.attempt), a.slurm_id or "-", a.state, str(a.requeues),
              "-" if a.exit_code is None else str(a.exit_code), a.node or "-", format_time(a.started_at),
              format_duration(a.ended_at - a.started_at if a.ended_at and a.started_at else None),
              a.error or ""] for a in attempts]
    print(render_table(["TRY", "SLURM_ID", "STATE", "REQUEUES", "EXIT", "NODE", "STARTED", "RUNTIME",
                        "ERROR"], cells, [{2: paint(a.state, colour)} for a in attempts]), file=out)
    for line in avoided_lines(attempts, avoided):
        print(line, file=out)
    if cause is not None:
        print(f"\nwhy try {attempts[-1].attempt} failed (its ranks' results and logs):\n{cause}", file=out)
    for flagged in slow:
        print(f"slow rank {flagged.get('rank')} on node {flagged.get('node')}: it entered the gradient "
              f"reduction {flagged.get('median_late_s')} s after the earliest rank "
              f"({flagged.get('windows')} logging windows in a row)", file=out)
    if hang is not None:
        where = hang_dumps.hang_dir(Path(job.run_dir))
        print(f"\ncollective timeout: {hang.get('verdict')}\nwhere each rank was ({where}):",
              *(f"  {line}" for line in hang.get("lines", [])), sep="\n", file=out)
    if memory:
        print("\n" + format_summary(memory), file=out)
    print(f"\nresolved config ({config_path}):\n{config_text}", end="", file=out)
    return 0


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [f for f in found if isinstance(f, dict)] if isinstance(found, list) else []


def failure_cause(job: Job, attempt: Attempt, executor: str) -> str | None:
    """For a SLURM attempt that failed: the report a single job prints (``submit.failure``), read
    from its ranks' result files and logs: the rank that failed first and its error, a rank killed
    by a signal, or the rank a hang waited for. The ERROR column holds what rank 0's status file
    says, which for a failure on another rank is the consequence ("Connection closed by peer").
    None when the attempt did not fail, or its logs or rank count are unknown."""
    ranks = num_ranks(job)
    if (executor != "slurm" or attempt.state != "FAILED" or not attempt.log_dir or not attempt.slurm_id
            or not ranks or not Path(attempt.log_dir).is_dir()):
        return None
    import submitit  # here: `switchyard status` stays light

    from orchestrator.launch import submit

    slurm_job: submitit.SlurmJob[Any] = submitit.SlurmJob(folder=attempt.log_dir, job_id=attempt.slurm_id,
                                                         tasks=tuple(range(ranks)))
    outcomes = submit.rank_outcomes(slurm_job)
    if all(o.error is None and o.no_output is None for o in outcomes):
        return None
    return str(submit.failure(slurm_job, outcomes, run_dir=Path(job.run_dir)))


def avoided_lines(attempts: list[Attempt], avoided: dict[int, list[dict[str, Any]]]) -> list[str]:
    """``try 2 avoided n2: rank 0 was killed by a signal (srun: Killed) in try 1``."""
    return [f"try {a.attempt} avoided {n['node']}: {n['why']} in try {n['attempt']}"
            for a in attempts for n in avoided.get(a.id, [])]


def cmd_cancel(registry: Registry, target: str, as_json: bool, out: IO[str] = sys.stdout,
               grace_s: float = local_jobs.KILL_WAIT_S) -> int:
    """scancel the target's live jobs; local jobs get the same SIGTERM, then SIGKILL after
    ``grace_s`` (default SLURM's KillWait, 30 s). Either way this returns once their ranks are
    gone (on SLURM, at most ``SLURM_END_WAIT_S`` later, naming the jobs still ending)."""
    if not grace_s >= 0:
        raise CommandError(f"--grace {grace_s} is invalid: give the seconds between SIGTERM and "
                           "SIGKILL, 0 or more")
    ref = parse_ref(registry, target)
    done = cancel(registry, ref.sweep_id, ref.num, grace_s, "switchyard cancel")
    cancelled, ending = done.attempts, done.ending
    ids = [a.slurm_id for a in cancelled]
    if as_json:
        print(json.dumps({"target": str(ref), "cancelled": [f"{a.sweep_id}/{a.num}" for a in cancelled],
                          "slurm_ids": ids, "still_ending": ending, "leftovers_stopped": done.leftovers}),
              file=out)
    else:
        if cancelled or not done.leftovers:
            print(f"cancelled {len(cancelled)} job(s) of {ref}: {', '.join(map(str, ids))}" if cancelled
                  else f"nothing to cancel in {ref}: every job has already ended", file=out)
        for job_id, count in done.leftovers.items():
            print(f"stopped {count} process(es) of local job {job_id} still running after its controller "
                  f"had died", file=out)
    if ending:
        print(f"job(s) {', '.join(ending)} still ending after {SLURM_END_WAIT_S:.0f} s: their ranks may "
              f"still be writing (a checkpoint, say); switchyard status {ref} shows when they end",
              file=sys.stderr)
    return 0


def cmd_resubmit(registry: Registry, target: str, failed: bool, as_json: bool,
                 out: IO[str] = sys.stdout) -> int:
    from orchestrator.sweeps import arrays  # submitit: only when submitting

    if not failed:
        raise CommandError("say which jobs to resubmit: --failed (failed, timed-out or cancelled)")
    ref = parse_ref(registry, target)
    if ref.num is not None:
        raise CommandError(f"resubmit takes a sweep: switchyard resubmit {ref.sweep_id} --failed")
    sweep = registry.sweep(ref.sweep_id)
    if registry.search(ref.sweep_id) is not None:  # its trials are asked by its controller, not saved
        raise CommandError(f"{ref.sweep_id} is a hyperparameter search: a failed trial is not rerun, the "
                           f"search asks new ones; a stopped controller resumes with `switchyard search "
                           f"resume {ref.sweep_id}`")
    if is_single(sweep.entry_path):
        raise CommandError(f"{ref.sweep_id} is a single job ({sweep.app}: {sweep.command or '-'}), not a "
                           f"sweep: it has no saved points to resubmit; run its command again (with "
                           f"hydra.run.dir={sweep.sweep_dir} to resume in its run directory)")
    print_warnings(reconcile(registry, [ref.sweep_id], ask_slurm=slurm_query.query_states), sys.stderr)
    try:
        resubmitted = arrays.resubmit_failed(registry, ref.sweep_id)
    except arrays.SweepError as e:
        raise CommandError(str(e)) from e
    if as_json:
        print(json.dumps({"sweep": ref.sweep_id, "resubmitted": [
            {"job": job.ref, "slurm_id": slurm_id, "overrides": job.overrides}
            for job, slurm_id in resubmitted]}), file=out)
        return 0
    if not resubmitted:
        print(f"nothing to resubmit in sweep {ref.sweep_id}: no job failed, timed out or was cancelled",
              file=out)
        return 0
    print(f"resubmitted {len(resubmitted)} job(s) of sweep {ref.sweep_id} from their saved configs:",
          file=out)
    avoided = registry.exclusions(ref.sweep_id)
    for job, _ in resubmitted:
        latest = registry.attempts(ref.sweep_id, job.num)[-1]
        for node in avoided.get(latest.id, []):
            print(f"keeping {job.ref} off {node['node']}: {node['why']} (try {node['attempt']})", file=out)
    shown = varying(registry.jobs(ref.sweep_id))
    print(render_table(["JOB", "SLURM_ID", "OVERRIDES"],
                       [[job.ref, slurm_id, " ".join(shown[job.num])] for job, slurm_id in resubmitted]),
          file=out)
    print(f"follow it with: {command(registry, 'status', ref.sweep_id)}", file=out)
    return 0


ERRORS = (CommandError, CancelError, RegistryError)
