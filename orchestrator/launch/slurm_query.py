"""Read job states and cluster limits from SLURM: ``sacct`` first, ``squeue`` when accounting is off.

Batched on purpose: one process per poll for up to a few thousand arrays (submitit polls sacct the
same way; the sweep registry reconciles hundreds of array tasks through here). Longer id lists go
in chunks: one argument may hold at most 128 KiB on Linux (MAX_ARG_STRLEN), and past that sacct
would not even start. A chunk neither command answered is reported, never dropped in silence.
"""

from __future__ import annotations

import functools
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY",
                             "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE"})
# One `-j` argument's length: a quarter of the kernel's 128 KiB per-argument limit, about 4,000
# array ids; also keeps each sacct query small for slurmdbd.
MAX_ID_LIST_CHARS = 32 * 1024
# SLURM's own defaults, used when `scontrol show config` does not list a value.
DEFAULT_MAX_ARRAY_SIZE = 1001
DEFAULT_MAX_JOB_COUNT = 10000


class SlurmQueryError(RuntimeError):
    """SLURM did not answer (neither sacct nor squeue, or scontrol)."""


@dataclass(frozen=True)
class StatesReply:
    """What SLURM said about a list of ids, chunk by chunk."""

    states: dict[str, str]  # {job id: STATE}; ids SLURM does not know are left out
    answered: frozenset[str]  # the asked ids whose chunk got an answer (known or not)
    errors: tuple[str, ...]  # one line per chunk that got none


def id_chunks(ids: Sequence[str], max_chars: int = MAX_ID_LIST_CHARS) -> list[list[str]]:
    """Consecutive runs of ``ids`` whose comma-separated list is at most ``max_chars`` long
    (an id longer than that on its own still gets a chunk: SLURM ids are a few characters)."""
    chunks: list[list[str]] = []
    size = 0
    for job_id in ids:
        if chunks and size + 1 + len(job_id) <= max_chars:
            chunks[-1].append(job_id)
            size += 1 + len(job_id)
        else:
            chunks.append([job_id])
            size = len(job_id)
    return chunks


def query_states(job_ids: Iterable[str], timeout_s: float = 30) -> StatesReply:
    """``{job_id: STATE}`` for the given ids (array tasks as ``ARRAY_TASK``), asked in chunks; a
    chunk sacct cannot answer goes to squeue; one neither answers is listed in ``errors``."""
    states: dict[str, str] = {}
    answered: set[str] = set()
    errors: list[str] = []
    for chunk in id_chunks(sorted(set(job_ids))):
        try:
            states.update(_from_sacct(chunk, timeout_s))
        except (subprocess.SubprocessError, OSError) as sacct_error:
            try:
                states.update(_from_squeue(chunk, timeout_s))
            except SlurmQueryError as e:
                what = chunk[0] if len(chunk) == 1 else f"{len(chunk)} jobs {chunk[0]}..{chunk[-1]}"
                errors.append(f"no state for {what}: sacct: {_reason(sacct_error)}; squeue: {e}")
                continue
        answered.update(chunk)
    return StatesReply(states, frozenset(answered), tuple(errors))


def job_states(job_ids: Iterable[str], timeout_s: float = 30) -> dict[str, str]:
    """``{job_id: STATE}`` for the given ids; raises SlurmQueryError when a part went unanswered."""
    reply = query_states(job_ids, timeout_s)
    if reply.errors:
        raise SlurmQueryError("; ".join(reply.errors))
    return reply.states


def _reason(error: BaseException) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        said = (error.stderr or error.stdout or "").strip().splitlines()
        return f"exit status {error.returncode}" + (f": {said[-1]}" if said else "")
    return str(error)


def _from_sacct(ids: list[str], timeout_s: float) -> dict[str, str]:
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(ids)],
                         capture_output=True, text=True, timeout=timeout_s, check=True).stdout
    states = {}
    for line in out.splitlines():
        job_id, _, state = line.partition("|")
        if job_id:
            states[job_id] = state.split()[0] if state else "UNKNOWN"  # "CANCELLED by 0" -> CANCELLED
    return states


def accounted_state(job_id: str, timeout_s: float = 30) -> str | None:
    """The job's state in accounting (``sacct``); None when accounting does not answer about it:
    sacct fails, or prints its header alone (slurmdbd down, restarting, or lagging behind)."""
    try:
        state = _from_sacct([job_id], timeout_s).get(job_id)
    except (subprocess.SubprocessError, OSError):
        return None
    return None if state in (None, "UNKNOWN") else state


def controller_state(job_id: str, timeout_s: float = 30) -> str | None:
    """The job's state in the controller (``squeue -t all``, which needs no slurmdbd): pending,
    running, and ended jobs slurmctld has not purged yet (MinJobAge). None when squeue no longer
    lists the job, or does not answer."""
    try:
        return controller_states([job_id], timeout_s).get(job_id)
    except SlurmQueryError:
        return None


def controller_states(job_ids: Sequence[str], timeout_s: float = 30) -> dict[str, str]:
    """``{job id: STATE}`` as slurmctld holds them now (``squeue -t all``): unlike accounting, a
    cancelled job whose ranks are still ending reads COMPLETING here. Ids squeue no longer lists
    are left out; raises SlurmQueryError when squeue does not answer."""
    states: dict[str, str] = {}
    for chunk in id_chunks(sorted(set(job_ids))):
        states.update(_from_squeue(chunk, timeout_s, every_state=True))
    return states


def _from_squeue(ids: list[str], timeout_s: float, every_state: bool = False) -> dict[str, str]:
    states = ["-t", "all"] if every_state else []
    try:
        proc = subprocess.run(["squeue", "-h", *states, "-o", "%i|%T", "-j", ",".join(ids)],
                              capture_output=True, text=True, timeout=timeout_s, check=False)
    except (subprocess.SubprocessError, OSError) as e:
        raise SlurmQueryError(str(e)) from e
    # squeue exits 1 when none of the ids is in the queue any more: an answer, not a failure.
    if proc.returncode != 0 and "Invalid job id" not in proc.stderr:
        said = proc.stderr.strip().splitlines()
        raise SlurmQueryError(f"exit status {proc.returncode}" + (f": {said[-1]}" if said else ""))
    return {job_id: state for job_id, _, state in
            (line.partition("|") for line in proc.stdout.splitlines()) if job_id}


def wait_for_terminal_states(job_ids: Iterable[str], timeout_s: float = 60,
                             poll_s: float = 0.5) -> dict[str, str]:
    """Poll until every job is in a terminal state (results can exist before SLURM records the end)."""
    ids = set(job_ids)
    deadline = time.monotonic() + timeout_s
    while True:
        states = job_states(ids)
        if all(states.get(i) in TERMINAL_STATES for i in ids) or time.monotonic() > deadline:
            return states
        time.sleep(poll_s)


# ------------------------------------------------------------------------------------------------
# Limits: how large a sweep the controller takes


@dataclass(frozen=True)
class ClusterLimits:
    """From ``scontrol show config``."""

    max_array_size: int  # array indices run 0..MaxArraySize-1; 0: job arrays are disabled
    max_job_count: int  # jobs slurmctld holds at once; every task of an array counts as one


def parse_limits(config_text: str) -> ClusterLimits:
    """``MaxArraySize`` and ``MaxJobCount`` from ``scontrol show config``'s ``Key = value`` lines."""
    values = {key.strip(): value.strip() for key, _, value in
              (line.partition("=") for line in config_text.splitlines())}

    def number(key: str, default: int) -> int:
        text = values.get(key, "").split()
        return int(text[0]) if text and text[0].isdigit() else default

    return ClusterLimits(number("MaxArraySize", DEFAULT_MAX_ARRAY_SIZE),
                         number("MaxJobCount", DEFAULT_MAX_JOB_COUNT))


@functools.cache
def cluster_limits() -> ClusterLimits:
    """The controller's limits, asked once per process (they change only when slurmctld restarts)."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        raise SlurmQueryError(f"scontrol show config: {_reason(e)}") from e
    return parse_limits(out)


def jobs_in_controller() -> int:
    """How many jobs slurmctld holds now, each array task counted (what MaxJobCount limits):
    pending, running, and ended ones it has not purged yet (MinJobAge)."""
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i"], capture_output=True,
                             text=True, timeout=60, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        raise SlurmQueryError(f"squeue: {_reason(e)}") from e
    return sum(1 for line in out.splitlines() if line.strip())


def partition_nodes() -> dict[str | None, list[str]]:
    """Each partition's node names, from one ``sinfo`` call; the default partition also under None."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %P"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        raise SlurmQueryError(f"sinfo: {_reason(e)}") from e
    found: dict[str | None, list[str]] = {}
    for line in out.splitlines():
        node, _, partition = line.strip().partition(" ")
        if not partition:
            continue
        names = [partition.rstrip("*"), *([None] if partition.endswith("*") else [])]
        for name in names:
            found.setdefault(name, [])
            if node not in found[name]:
                found[name].append(node)
    return found


def hostnames(node_list: str) -> list[str]:
    """A node list in SLURM's syntax (``gpu[01-03],n2``) as names (``scontrol show hostnames``)."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", node_list], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (subprocess.SubprocessError, OSError) as e:
        raise SlurmQueryError(f"scontrol show hostnames {node_list}: {_reason(e)}") from e
    return out.split()
