"""Which node an attempt that failed leaves behind: its next attempt is submitted with it in
``--exclude``, so a "black hole" node (a broken GPU or file system, where every job dies in
seconds) does not take the retries too.

A node is blamed for what is the node's doing, not the code's:
- a node failure: SLURM ended the job NODE_FAIL (the node stopped answering);
- a rank killed by a signal: srun reports the task ``Killed``, ``Segmentation fault``, ``Bus error``...
  (a rank that exits with an error code is the code's, and blames nobody). Only what srun reports
  before it starts stopping the other tasks counts: those are consequences. A ``switchyard run``
  command killed by a signal counts the same: its rank's Switchyard process survives it and exits
  with an error, so srun sees an exit code, and the rank's own report says which signal
  (``rank 1 on node n2: `python x.py` was killed by SIGKILL``); a report that ends
  ``after rank N had failed`` is a consequence, and SIGTERM (a stop asked for) blames nobody, as
  srun's ``Terminated`` does not;
- a CUDA or NCCL error in the last lines of a rank's log (an ECC error, ``CUDA error: ...``,
  ``NCCL error``; a device-side assert is the code's);
- a rank rank 0 flagged as persistently slow (``training.stragglers``: its line in rank 0's log),
  weakest evidence, so only where nothing above blames a node.

Pure functions over log text (``from_logs``) and one reader of an attempt's submitit logs
(``of_attempt``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# srun's report of a task that ended on its own, or the node launcher's of a forked rank in srun's
# words (orchestrator/launch/node_launcher.py). Not anchored at a line start: a progress bar's last
# "\r" frame has no newline after it.
TASK_ERROR = re.compile(r"(srun|switchyard launcher): error: (\S+): tasks? ([\d,-]+): ([^\r\n]+)")
# With node launchers srun's tasks are the launchers, one per node: its task N is node N's ranks.
LAUNCHER_STARTED = re.compile(r"switchyard launcher: node (\S+) \(task (\d+)\) runs ranks (\d+)-(\d+)")
# srun --kill-on-bad-exit stopping the others, or a launcher its node's others: what follows is a consequence
STOPPING = ("_step_signal: Terminating", "switchyard launcher: stopping")
_EXITED = re.compile(r"^exited with exit code \d+$", re.IGNORECASE)
_DEVICE_ERROR = re.compile(r"CUDA error(?!: device-side assert)|cudaError\w+|CUDA driver error|"
                           r"uncorrectable ECC|\bXid\b|NCCL error|unhandled cuda error|"
                           r"unhandled system error", re.IGNORECASE)
# An NCCL error that only says another rank went away: the other rank's node, not this one.
_PEER_LOST = re.compile(r"remote process exited|Connection (reset|closed)|Broken pipe|timed? ?out",
                        re.IGNORECASE)
_BANNER = re.compile(r"switchyard: rank (\d+)/\d+ on node (\S+)")
# training.stragglers.Straggler.line: a rank rank 0 found persistently late into the reduction;
# rank 0 also keeps them in RUN/stragglers.json (switchyard show reads it)
STRAGGLERS_FILE = "stragglers.json"
SLOW_LINE_PREFIX = "switchyard: slow rank"
_SLOW = re.compile(SLOW_LINE_PREFIX + r" (\d+) on node (\S+): it enters the gradient reduction "
                   r"([\d.]+) s after")
# scripts.rank.describe_failure's first line for a command killed by a signal.
_COMMAND_KILLED = re.compile(r"rank (\d+) on node (\S+): `[^`\n]*` was killed by (SIG[A-Z0-9]+)([^\n]*)")
NOT_THE_NODES = frozenset({"SIGTERM", "SIGUSR2"})  # stop requests: preemption, cancel, the time limit
TAIL_LINES = 20


@dataclass(frozen=True)
class BadNode:
    node: str
    why: str  # for people: what happened there, shown by `switchyard show`

    def as_dict(self) -> dict[str, str]:
        return {"node": self.node, "why": self.why}


def srun_errors(batch_stderr: str) -> list[tuple[str, int, str]]:
    """(node, rank, srun's reason) for each rank srun (or a node launcher) saw end on its own, in
    their order, up to the point where one of them starts stopping the others. srun's line for a
    node launcher that said nothing itself (killed outright: its ranks died with it) names each of
    that node's ranks."""
    launchers = {int(task): (node, int(lo), int(hi))
                 for node, task, lo, hi in LAUNCHER_STARTED.findall(batch_stderr)}
    cut = min((i for marker in STOPPING if (i := batch_stderr.find(marker)) >= 0), default=None)
    found: list[tuple[str, int, str]] = []
    said: set[str] = set()  # nodes whose launcher reported a rank itself
    for who, node, tasks, reason in TASK_ERROR.findall(batch_stderr[:cut]):
        if reason.strip() == "Terminated":
            continue
        for task in _task_ids(tasks):
            if who == "srun" and launchers:
                launcher_node, lo, hi = launchers.get(task, (node, task, task))
                if launcher_node not in said:
                    found += [(launcher_node, rank, reason.strip()) for rank in range(lo, hi + 1)]
                continue
            said.add(node)
            found.append((node, task, reason.strip()))
    return found


def _task_ids(tasks: str) -> list[int]:
    """srun's ``0,2-3`` -> [0, 2, 3]."""
    ids: list[int] = []
    for part in tasks.split(","):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


def from_logs(state: str, job_nodes: Sequence[str], batch_stderr: str,
              rank_logs: Mapping[int, tuple[str | None, str]]) -> list[BadNode]:
    """The nodes one ended attempt blames, each once, strongest evidence first. ``rank_logs``:
    rank -> (its node, its log's text)."""
    blamed: dict[str, str] = {}
    if state == "NODE_FAIL":
        for node in job_nodes:
            blamed.setdefault(node, "node failure (SLURM ended the job NODE_FAIL)")
    for node, rank, reason in srun_errors(batch_stderr):
        if not _EXITED.match(reason):
            blamed.setdefault(node, f"rank {rank} was killed by a signal (srun: {reason})")
    for node, rank, how in commands_killed(rank_logs):
        blamed.setdefault(node, f"rank {rank}'s command was killed by {how}")
    if blamed:  # a rank killed: its peers' errors (a lost NCCL connection) are consequences
        return [BadNode(node, why) for node, why in blamed.items()]
    for rank, (rank_node, text) in sorted(rank_logs.items()):
        line = next((line for line in reversed(text.splitlines()[-TAIL_LINES:])
                     if _DEVICE_ERROR.search(line) and not _PEER_LOST.search(line)), None)
        if rank_node is not None and line is not None:
            blamed.setdefault(rank_node, f"rank {rank}'s log ends with a CUDA/NCCL error: "
                                         f"{line.strip()[:200]}")
    if blamed:
        return [BadNode(node, why) for node, why in blamed.items()]
    for _, text in rank_logs.values():
        for slow_rank, node, late in _SLOW.findall(text):
            blamed.setdefault(node, f"rank {slow_rank} was persistently slow there: it entered the "
                                    f"gradient reduction {late} s after the others")
    return [BadNode(node, why) for node, why in blamed.items()]


def commands_killed(rank_logs: Mapping[int, tuple[str | None, str]]) -> list[tuple[str, int, str]]:
    """(node, rank, ``SIGKILL (the OOM killer: ...)``) for each ``switchyard run`` command that a
    signal ended of its own (not a stop request, not after another rank had failed)."""
    found = []
    for rank, (rank_node, text) in sorted(rank_logs.items()):
        for match in _COMMAND_KILLED.finditer(text):
            said_rank, node, name, rest = match.groups()
            if int(said_rank) == rank and name not in NOT_THE_NODES and "had failed" not in rest:
                found.append((rank_node or node, rank, f"{name}{rest}".strip()))
                break
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def of_attempt(log_dir: Path, job_id: str, state: str, node: str | None) -> list[BadNode]:
    """``from_logs`` over a submitit attempt's logs (``JOBID_TASK_log.out|err``; task 0's .err
    also holds the batch script's, where srun reports). ``node``: where the registry saw it run."""
    rank_logs: dict[int, tuple[str | None, str]] = {}
    for out in sorted(log_dir.glob(f"{job_id}_*_log.out")):
        text = _read(out)
        banner = _BANNER.search(text[:8192])
        if banner is None:
            continue
        err = out.with_name(out.name.removesuffix(".out") + ".err")
        rank_logs[int(banner.group(1))] = (banner.group(2), text + "\n" + _read(err))
    nodes = [node] if node else sorted({n for n, _ in rank_logs.values() if n})
    return from_logs(state, nodes, _read(log_dir / f"{job_id}_0_log.err"), rank_logs)


def exclude_list(user_exclude: str | None, nodes: Sequence[str]) -> str | None:
    """``--exclude``: the user's own (node-list syntax, kept as written) and the nodes left behind."""
    parts = [p for p in (user_exclude, ",".join(nodes)) if p]
    return ",".join(parts) or None
