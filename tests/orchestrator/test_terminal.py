"""Control characters from user input or logs reach the terminal escaped, never raw."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from train_helpers import run_train

from orchestrator.terminal import printable, refuse_control

ESC = "\x1b[2J\x1b[31m"  # clear the screen, then print in red


def test_printable_escapes_controls_and_keeps_lines() -> None:
    assert printable(f"a{ESC}b\rc\x07\x9b\n\tz") == "a\\x1b[2J\\x1b[31mb\\rc\\x07\\x9b\n\tz"


def test_arguments_with_control_characters_are_named_escaped() -> None:
    message = refuse_control(["prog", "optim.lr=1", f"data.path=/x{ESC}"])
    assert message is not None and message.startswith("argument 2 (data.path=/x\\x1b[2J")
    assert "\x1b" not in message
    assert refuse_control(["prog", "data.path=/x y", "optim.lr=1e-3"]) is None


def test_the_training_job_refuses_them_before_hydra_echoes_them(tmp_path: Path) -> None:
    proc = run_train(f"data.path=/tmp/{ESC}", timeout=120)
    assert proc.returncode != 0
    assert "\x1b" not in proc.stdout + proc.stderr and "holds control characters" in proc.stderr


def test_an_error_that_carries_them_is_printed_escaped(tmp_path: Path) -> None:
    """A model module whose import fails with an escape sequence in its message (it could as well be
    a rank's log tail or a dataset's field name)."""
    (tmp_path / "hostile_model.py").write_text(f"raise ImportError({ESC + 'gone'!r})\n")
    proc = run_train("model=custom", "model._target_=hostile_model.Net", cache_dir=tmp_path / "cache",
                     run_dir=tmp_path / "run", timeout=300,
                     env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "\\x1b[2J\\x1b[31mgone" in proc.stderr
    assert "\x1b" not in proc.stderr


def test_switchyard_verify_and_plot_show_a_path_argument_escaped(tmp_path: Path) -> None:
    """The path is echoed in the report (verify) and in the error (plot): never raw."""
    switchyard = str(Path(sys.executable).with_name("switchyard"))
    for command in ("verify", "plot"):
        proc = subprocess.run([switchyard, command, str(tmp_path / f"missing{ESC}")],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0, (command, proc.stdout, proc.stderr)
        output = proc.stdout + proc.stderr
        assert "missing\\x1b[2J\\x1b[31m" in output, (command, output)
        assert "\x1b" not in output, command
