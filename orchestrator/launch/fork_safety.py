"""When a fork is safe: the one home of the checks both forking starts make, the local job's
controller (``fork_start``) and the SLURM node launcher (``node_launcher``).

A fork is only safe from a process that has started nothing the children would share: no CUDA
context (a child of a process with one cannot use CUDA), no thread (one holding a lock at the fork
leaves it held forever in every child), no process group. numpy's OpenBLAS starts its thread pool
at import, and torch's import GNU OpenMP's, one thread per core, unless ``THREAD_VARS`` say 1: so a
forking process imports with them at 1 (``hold_thread_pools``) and puts the user's values back
before it forks (``restore_thread_vars``); the ranks size their own pools after the fork
(``runtime.thread_budget``), as a started rank does.

Imports the standard library alone: the node launcher calls ``hold_thread_pools`` before anything
that imports numpy (submitit's ``submission`` module does).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

PRELOAD_ENV = "SWITCHYARD_RANK_PRELOAD"  # the modules imported before forking, comma-separated
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
USERS_THREAD_VARS = "SWITCHYARD_USERS_THREAD_VARS"  # the user's values, while the imports run at 1


def hold_thread_pools() -> bool:
    """Save the user's ``THREAD_VARS`` and set them to 1, before the imports that start pools.
    -> whether this call held them: False where they are held already (a process that holds them
    imports a module that holds them too), and then only the outer holder restores them."""
    if USERS_THREAD_VARS in os.environ:
        return False
    os.environ[USERS_THREAD_VARS] = json.dumps({k: os.environ.get(k) for k in THREAD_VARS})
    os.environ.update(dict.fromkeys(THREAD_VARS, "1"))
    return True


def restore_thread_vars() -> None:
    """The user's ``THREAD_VARS`` again (unset where they were), once the imports are done."""
    saved = json.loads(os.environ.pop(USERS_THREAD_VARS, "{}"))
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def why_not_fork(preload: Sequence[str]) -> str | None:
    """Import ``preload`` (and find submitit's job environments, which every rank asks first:
    ``discover_job_environments``); None if a fork from here is safe, else what makes it unsafe."""
    try:
        if not preload:
            return "this job names no modules to import first"
        for name in preload:
            try:
                importlib.import_module(name)
            except Exception as e:  # the rank will meet it again, and report it as today
                return f"importing {name} failed ({type(e).__name__}: {e})"
        discover_job_environments()
    finally:
        restore_thread_vars()
    return why_not_fork_now()


def discover_job_environments() -> None:
    """What each rank's ``process_job`` asks first: submitit finds its job environments by reading
    the entry points of every installed package (about 30 ms, cached for the process). Asked once
    here, every forked rank inherits the answer."""
    from submitit.core import plugins

    plugins.get_job_environments()


def why_not_fork_now() -> str | None:
    """None if a fork from this process, as it is, is safe; else what makes it unsafe."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "an import initialised CUDA, which a forked child cannot use"
    tasks = Path("/proc/self/task")
    threads = len(os.listdir(tasks)) if tasks.is_dir() else threading.active_count()  # C threads too
    if threads > 1:
        return (f"an import started {threads - 1} thread(s), which a fork would leave in every "
                f"child without them")
    return None
