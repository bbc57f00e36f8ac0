"""The batch script's restart loop (``orchestrator/launch/restarts.py``), run by bash with a stand-in
for srun whose exits the test chooses; the real job step is in tests/slurm/test_restarts_on_slurm.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

from orchestrator.launch import restarts

SCRIPT = ("#!/bin/bash\n#SBATCH --nodes=2\n\n# command\nexport SUBMITIT_EXECUTOR=slurm\n"
          "srun --unbuffered step\n")


def run_loop(tmp_path: Path, steps: list[str], allowed: int) -> tuple[int, str, int]:
    """(exit status, stderr, starts) of the wrapped script; ``steps[k]`` is the shell the k-th start
    of the step runs (it sees SWITCHYARD_ATTEMPT_DIR as the ranks do), then exits with its status."""
    folder = tmp_path / "submitit"
    folder.mkdir()
    cases = "\n".join(f"    {k}) {body} ;;" for k, body in enumerate(steps))
    fake = ("srun() {\n  n=$(cat starts 2>/dev/null || echo 0); echo $((n + 1)) > starts\n"
            f"  case $n in\n{cases}\n  esac\n}}\n")
    script = restarts.wrap(SCRIPT, allowed, folder).replace("# command\n", f"# command\n{fake}", 1)
    proc = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "0"})
    return proc.returncode, proc.stderr, int((tmp_path / "starts").read_text())


def test_no_restarts_leaves_submitits_script_as_it_is(tmp_path: Path) -> None:
    assert restarts.wrap(SCRIPT, 0, tmp_path) == SCRIPT


def test_a_failed_step_starts_again_and_the_job_ends_with_the_steps_status(tmp_path: Path) -> None:
    code, err, starts = run_loop(tmp_path, ["return 137", "return 0"], allowed=2)
    assert (code, starts) == (0, 2)
    assert "the step failed (exit 137); restart 1/2 inside allocation 77" in err


def test_restarts_used_up_end_the_job_failed(tmp_path: Path) -> None:
    code, err, starts = run_loop(tmp_path, ["return 1", "return 137"], allowed=1)
    assert (code, starts) == (137, 2)
    assert "its 1 restart(s) inside the allocation are used up" in err


def test_the_same_failure_twice_in_a_row_stops_the_restarts(tmp_path: Path) -> None:
    bug = 'printf "step 3\\nValueError: bug\\n" > "$SWITCHYARD_ATTEMPT_DIR/rank-1"; return 1'
    code, err, starts = run_loop(tmp_path, [bug, bug, "return 0"], allowed=5)
    assert (code, starts) == (1, 2) and "the same failure twice in a row" in err
    other = 'printf "step 9\\nValueError: bug\\n" > "$SWITCHYARD_ATTEMPT_DIR/rank-1"; return 1'
    for leftover in ("starts", "submitit"):
        subprocess.run(["rm", "-rf", str(tmp_path / leftover)], check=True)
    code, _, starts = run_loop(tmp_path, [bug, other, "return 0"], allowed=5)
    assert (code, starts) == (0, 3)  # another step: not the same failure


def test_a_stop_is_not_restarted(tmp_path: Path) -> None:
    stop = 'touch submitit/77_0_result.stopped; return 143'
    code, err, starts = run_loop(tmp_path, [stop, "return 0"], allowed=3)
    assert (code, starts) == (143, 1) and "restart" not in err


def test_each_start_records_when_its_step_ended(tmp_path: Path) -> None:
    run_loop(tmp_path, ["return 1", "return 0"], allowed=1)
    ended = sorted((tmp_path / "submitit" / restarts.DIR).glob(f"77-0-*/{restarts.FAILED_AT}"))
    assert [p.parent.name for p in ended] == ["77-0-0", "77-0-1"]
    assert float(ended[0].read_text()) <= float(ended[1].read_text())
