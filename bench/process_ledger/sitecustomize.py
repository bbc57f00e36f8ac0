"""Every Python process's own CPU seconds, one JSON line each, for finding where a run's CPU goes.

With this folder on ``PYTHONPATH`` (or this file run by a ``.pth`` line in a venv's
site-packages, which reaches every process the venv's python starts) and ``PROC_LEDGER=FILE``
set, each interpreter (and each child it forks: forked ranks, node launchers' ranks) appends
``{"pid", "forked", "argv", "test", "cpu", "wall"}`` to FILE when it ends, by ``atexit`` or by
``os._exit`` (Switchyard's commands leave by ``os._exit``; forked ranks too). ``test`` is
``PYTEST_CURRENT_TEST`` as the process inherited it, so a suite's processes are told by the test
that started them; SLURM jobs inherit it through ``sbatch``'s environment.
``bench/process_ledger.py FILE`` sums the lines by kind of process.

Unlike ``tests/conftest.py``'s ``SWITCHYARD_TEST_CPU``, which sums a test's waited-for children,
this sees every process: a SLURM job's ranks under ``slurmd``, and which of a test's processes
cost what (the submitting ``jobs.train``, a local controller, a rank). Without ``PROC_LEDGER``
it does nothing.
"""

import atexit
import json
import os
import resource
import sys
import time

_LEDGER = os.environ.get("PROC_LEDGER")
# Once per process: a venv's site-packages is often reached twice (lib64 is a link to lib), and
# site.py then runs a .pth file in it twice, which would register a second writer.
_ONCE = "_switchyard_process_ledger"

if _LEDGER and not getattr(sys, _ONCE, False):
    setattr(sys, _ONCE, True)
    _first_pid = os.getpid()
    _started = [time.time()]
    _written = [False]

    def _write() -> None:
        if _written[0]:
            return
        _written[0] = True
        usage = resource.getrusage(resource.RUSAGE_SELF)
        line = {"pid": os.getpid(), "forked": os.getpid() != _first_pid, "argv": sys.argv[:6],
                "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                "cpu": usage.ru_utime + usage.ru_stime, "wall": time.time() - _started[0]}
        try:
            with open(_LEDGER, "a") as ledger:
                ledger.write(json.dumps(line) + "\n")
        except OSError:
            pass

    atexit.register(_write)
    _exit = os._exit

    def _exit_written(code: int) -> None:
        _write()
        _exit(code)

    os._exit = _exit_written  # type: ignore[assignment]

    def _child() -> None:  # a forked child's own line; its CPU counts from the fork
        _written[0] = False
        _started[0] = time.time()

    os.register_at_fork(after_in_child=_child)
