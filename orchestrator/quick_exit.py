"""A process that has done its work ends at once.

A process that imported torch spends half a second to a second or more in the interpreter's
finalisation after its last line has run: freeing torch's modules and C++ state, which nothing will
read again (1.4 s measured for ``jobs.train`` on the 2-core test machine, after the summary was
printed; 0.55 s for a process that imported ``torch.distributed`` and submitit, against 0.05 s
without torch). Two ways out skip it:

- ``exit_now``: a submitter waiting on its job has printed its result and closed what it wrote,
  so it flushes its output and logs and leaves with ``os._exit``. Only a successful end (or an
  error already reported) takes this path: an error that raises unwinds the usual way, so every
  ``finally`` runs.
- ``exit_as_interpreter``: a job's process (a forked rank or controller, or a started one whose
  code is all Switchyard's: ``launch/job_entry.py``) runs its work, then leaves as the interpreter
  would, with the same exit status, ``atexit``'s functions run and the output flushed, but without
  the teardown. What the teardown alone would do, it does not: flush a file object that is still
  open in a module's globals. So a process that runs a user's own Python function (``switchyard
  submit``, a plain Hydra app's sweep point) keeps the interpreter's usual end.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn


def exit_now(code: int = 0) -> NoReturn:
    logging.shutdown()  # Hydra's train.log and any other handler: flushed and closed
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def exit_as_interpreter(work: Callable[[], object], join_threads: bool = False) -> NoReturn:
    """Run ``work``, then leave as an interpreter running it would: the status ``sys.exit`` gives,
    or the traceback and 1 (after a ``KeyboardInterrupt``: killed by SIGINT, 130 in a shell);
    ``atexit``'s functions (torch's, logging's), the output flushed; ``join_threads``: non-daemon
    threads joined first, as the interpreter joins them. Never returns."""
    code, interrupted = 1, False
    try:
        work()
        code = 0
    except SystemExit as e:
        code = exit_code(e)
    except KeyboardInterrupt:  # as the interpreter would: the traceback, then death by SIGINT (130)
        traceback.print_exc()
        code, interrupted = 128 + signal.SIGINT, True
    except BaseException:  # as the interpreter would: the traceback, exit 1
        traceback.print_exc()
    finally:
        try:
            if join_threads:
                threading._shutdown()  # type: ignore[attr-defined]
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            if interrupted:  # a shell (and a parent's waitpid) sees a process killed by Ctrl-C
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
        finally:
            os._exit(code)


def exit_code(e: SystemExit) -> int:
    """The status ``sys.exit(value)`` gives a process: 0 for None, the int, else 1 (printed)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1
