"""StateWatch: a SLURM job's state read through a gap in accounting (issue 27: a job that had
COMPLETED was waited for 10.5 minutes in silence while sacct printed its header alone).

sacct and squeue are small scripts first on PATH here (tests/slurm_fakes.py); the job on the real
cluster is tests/slurm/test_accounting_gap_on_slurm.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import submitit
from slurm_fakes import fake_slurm

from orchestrator.launch import submit

SILENT_SACCT = 'echo "JobID|State"'  # what sacct prints while slurmdbd is down: its header alone


def a_job(tmp_path: Path, with_result: bool) -> submitit.SlurmJob[object]:
    job: submitit.SlurmJob[object] = submitit.SlurmJob(folder=tmp_path / "logs", job_id="4242")
    if with_result:
        job.paths.result_pickle.parent.mkdir(parents=True, exist_ok=True)
        job.paths.result_pickle.write_bytes(b"")
    return job


def test_accounting_answers_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct='echo "4242|RUNNING"', squeue="exit 1")
    assert submit.StateWatch(a_job(tmp_path, False), patience_s=0).state() == "RUNNING"
    assert capsys.readouterr().err == ""


def test_a_job_the_controller_still_holds_is_read_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct=SILENT_SACCT, squeue='echo "4242|COMPLETED"')
    assert submit.StateWatch(a_job(tmp_path, False), patience_s=0).state() == "COMPLETED"
    assert capsys.readouterr().err == ("switchyard: SLURM accounting has not answered about job 4242 "
                                       "for 0 s; squeue lists it COMPLETED\n")


def test_a_forgotten_job_with_every_result_written_has_ended(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct=SILENT_SACCT, squeue="true")
    assert submit.StateWatch(a_job(tmp_path, True), patience_s=60).state() == submit.ENDED
    assert capsys.readouterr().err == "", "nothing was waited for"


def test_a_forgotten_job_without_results_is_waited_for_then_reported(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct=SILENT_SACCT, squeue="true")
    job = a_job(tmp_path, False)
    assert submit.StateWatch(job, patience_s=3600).state() == "UNKNOWN"  # a result may be on its way
    assert capsys.readouterr().err == ""
    assert submit.StateWatch(job, patience_s=0).state() == submit.ENDED
    assert capsys.readouterr().err == ("switchyard: SLURM accounting has not answered about job 4242 for "
                                       "0 s; squeue no longer lists it, and ranks [0] wrote no result: "
                                       "taken as ended\n")


def test_the_silence_is_reported_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    fake_slurm(tmp_path, monkeypatch, sacct=SILENT_SACCT, squeue='echo "4242|PENDING"')
    watch = submit.StateWatch(a_job(tmp_path, False), patience_s=0)
    assert [watch.state() for _ in range(3)] == ["PENDING"] * 3
    assert capsys.readouterr().err.count("has not answered") == 1
