"""``exit_now`` skips the interpreter's finalisation but loses nothing written before it: buffered
output, a log handler's file, the exit code."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import atexit, logging, sys
from orchestrator.quick_exit import exit_now
logging.basicConfig(filename=sys.argv[1], level=logging.INFO)
logging.info("logged before the exit")
atexit.register(print, "finalised")  # the usual shutdown would run this; exit_now skips it
sys.stdout.write("no newline, still buffered")
sys.stderr.write("to stderr")
exit_now(3)
"""


def test_output_and_logs_are_flushed_and_the_code_kept(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(log)], capture_output=True, text=True,
                          env={"PYTHONUNBUFFERED": "", "PATH": "/usr/bin"}, cwd=Path(__file__).parents[2])
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "no newline, still buffered" and proc.stderr == "to stderr"
    assert "logged before the exit" in log.read_text()


INTERRUPTED = """
import atexit
from orchestrator.quick_exit import exit_as_interpreter
atexit.register(print, "atexit ran")
def work():
    raise KeyboardInterrupt
exit_as_interpreter(work)
"""


def test_an_interrupted_process_ends_killed_by_sigint_as_the_interpreters_would() -> None:
    """Ctrl-C on a `switchyard run` (which ends through exit_as_interpreter) reads as 130 in a shell,
    as a plain Python process's does; it read as 1."""
    plain = subprocess.run([sys.executable, "-c", "raise KeyboardInterrupt"], capture_output=True, text=True)
    ours = subprocess.run([sys.executable, "-c", INTERRUPTED], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])
    assert plain.returncode == ours.returncode == -signal.SIGINT
    assert "KeyboardInterrupt" in ours.stderr and ours.stdout == "atexit ran\n"
