"""Every value the user types, at every entry point, is one ``error:`` line when it is wrong: never a
traceback, never silently accepted, control characters shown escaped.

The sweep calls each entry point in-process (``orchestrator.cli.main`` with its argv; for the Hydra
apps, the checks their ``__main__`` runs: ``entry.refuse_argv``, Hydra's compose, the config's
checks and those before submission); one real subprocess per entry point keeps the exit code and
the printed line honest.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from train_helpers import run_train

from orchestrator import cli, entry
from orchestrator.config import ConfigError
from orchestrator.registry.db import Job, Registry, Submitted
from orchestrator.sweeps.prune import cmd_prune
from orchestrator.sweeps.status import cmd_status
from orchestrator.terminal import one_line
from sharding.format import DatasetError

HUGE = str(10**30)
ESC = "a\x1b[2Jb"  # clear the screen, if a terminal ever got it raw
LONG = "x" * 10_000
SWITCHYARD = str(Path(sys.executable).with_name("switchyard"))

# what the user typed -> a readable test id
VALUES = {"huge": HUGE, "negative": "-1", "zero": "0", "dollar": "${", "esc": ESC, "newline": "a\nb",
          "long": LONG}


@pytest.fixture(scope="module")
def where(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A registry holding one sweep of one 2-rank job, and paths that cannot be what is asked."""
    root = tmp_path_factory.mktemp("hostile")
    with Registry(root / "registry.db") as reg:
        sweep_id = reg.create_sweep("train", "optim.lr=0.1", str(root / "sweep"), "local", "entry")
        resources = {"executor": "local", "params": {"nodes": 1, "tasks_per_node": 2}}
        reg.add_jobs([Job(sweep_id, 0, ["optim.lr=0.1"], str(root / "sweep" / "0"), resources, 10)])
        claims = reg.claim(sweep_id, [0])
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()  # a pid that has ended: the job reads as ended, nothing to signal
        reg.confirm([Submitted(claims[0], str(proc.pid), None, None, str(root / "logs"))])
    (root / "file").write_text("not a directory\n")
    os.mkfifo(root / "fifo")
    (root / "store").mkdir()
    (root / "not-a-store").mkdir()
    (root / "not-a-store" / "notes.txt").write_text("mine\n")
    return {"registry": str(root / "registry.db"), "sweep": str(sweep_id), "root": str(root),
            "missing": str(root / "missing"), "under_file": str(root / "file" / "child"),
            "file": str(root / "file"), "fifo": str(root / "fifo"), "dir": str(root),
            "store": str(root / "store"), "not_a_store": str(root / "not-a-store")}


def fill(text: str, where: dict[str, str]) -> str:
    """``{sweep}``, ``{missing}``, ... replaced; a hostile ``${`` left as it is (no str.format)."""
    for key, value in where.items():
        text = text.replace(f"{{{key}}}", value)
    return text


def call_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


def assert_one_error_line(rc: int, out: str, err: str, code: int = 2) -> str:
    assert "Traceback" not in out + err, err
    assert rc == code, (rc, out, err[-2000:])
    lines = err.splitlines()
    assert len(lines) == 1 and "error: " in lines[0], err[-2000:]
    assert "\x1b" not in out + err, "ESC must be escaped when it is echoed"
    return lines[0]


# ------------------------------------------------------------------------------------------------
# switchyard: ids, numbers, paths


ID_COMMANDS = {"status": [], "show": [], "logs": [], "cancel": [], "resubmit": ["--failed"]}
IDS = {**VALUES, "huge-job": "{sweep}/" + HUGE, "huge-sweep": HUGE + "/0", "no-such-job": "{sweep}/42",
       "no-such-sweep": "777/0"}


@pytest.mark.parametrize("value", IDS.values(), ids=IDS.keys())
@pytest.mark.parametrize("command", ID_COMMANDS)
def test_a_wrong_id_is_one_error_line(where: dict[str, str], command: str, value: str) -> None:
    argv = [command, fill(value, where), *ID_COMMANDS[command], "--registry", where["registry"]]
    assert_one_error_line(*call_cli(argv))


@pytest.mark.parametrize("digits", ["０１２３４５６７８９", "٠١٢٣٤٥٦٧٨٩"], ids=["fullwidth", "arabic-indic"])
def test_an_id_or_number_in_other_digits_is_one_error_line_naming_the_ascii_one(
        where: dict[str, str], digits: str) -> None:
    """``status １`` showed sweep 1 (``int`` and ``\\d`` take any Unicode digit), and
    ``logs --rank ７`` read rank 7's log: each is now refused, naming what to type."""
    sweep, registry = where["sweep"], ["--registry", where["registry"]]
    other = "".join(digits[int(c)] for c in sweep)
    for command, target in (("status", other), ("status", f"{other}/0"), ("show", f"{sweep}/{digits[0]}"),
                            ("logs", f"{other}/0"), ("cancel", other)):
        line = assert_one_error_line(*call_cli([command, target, *registry]))
        fixed = target.replace(other, sweep).replace(digits[0], "0")
        assert line == (f"switchyard {command}: error: the id {target!r} is invalid: write it in the "
                        f"digits 0-9 (try {fixed!r})")
    for option in ("--rank", "--attempt"):
        line = assert_one_error_line(*call_cli(["logs", f"{sweep}/0", option, digits[1], *registry]))
        assert f"argument {option}: {digits[1]!r} is invalid: write a whole number in the digits 0-9" in line


NUMBERS = {
    "logs --rank": (["logs", "{sweep}/0", "--rank"], [HUGE, "-1", "2", "${", ESC, LONG]),
    "logs --attempt": (["logs", "{sweep}/0", "--attempt"], [HUGE, "-1", "0", "${", ESC, LONG]),
    "cancel --grace": (["cancel", "{sweep}/0", "--grace"], ["-1", "nan", "${", ESC, "a\nb", LONG]),
    "snapshots --older-than-days": (["snapshots", "prune", "--store", "{store}", "--older-than-days"],
                                    ["-1", "nan", "${", ESC, LONG]),
}


@pytest.mark.parametrize(("option", "value"), [(o, v) for o, (_, vs) in NUMBERS.items() for v in vs],
                         ids=[f"{o}={v[:12]!r}" for o, (_, vs) in NUMBERS.items() for v in vs])
def test_a_wrong_number_is_one_error_line(where: dict[str, str], option: str, value: str) -> None:
    argv = [fill(a, where) for a in NUMBERS[option][0]]
    assert_one_error_line(*call_cli([*argv, value, "--registry", where["registry"]]))


PATHS = ["missing", "under_file", "fifo", "long", "esc", "newline"]
PATH_COMMANDS = {
    "verify": (["verify"], [*PATHS, "file"]),
    "plot": (["plot"], [*PATHS, "file"]),
    "plot --out": (["plot", "{root}", "--out"], ["dir", "fifo", "under_file", "long"]),
    "--registry": (["status", "--registry"], [*PATHS, "dir"]),
    "snapshots --store": (["snapshots", "prune", "--dry-run", "--store"], [*PATHS, "file", "not_a_store"]),
}


def path_of(where: dict[str, str], kind: str) -> str:
    return {"long": LONG, "esc": f"{where['root']}/{ESC}", "newline": f"{where['root']}/a\nb"}.get(
        kind) or where[kind]


@pytest.mark.parametrize(("command", "kind"), [(c, k) for c, (_, ks) in PATH_COMMANDS.items() for k in ks],
                         ids=[f"{c}={k}" for c, (_, ks) in PATH_COMMANDS.items() for k in ks])
def test_a_wrong_path_is_one_error_line(where: dict[str, str], command: str, kind: str) -> None:
    argv = [fill(a, where) for a in PATH_COMMANDS[command][0]]
    if command == "plot --out":  # a run directory with samples, so that --out is what is wrong
        telemetry = Path(where["root"]) / "telemetry"
        telemetry.mkdir(exist_ok=True)
        (telemetry / "n1.jsonl").write_text('{"t": 1.0, "node": "n1", "gpus": []}\n')
    rc, out, err = call_cli([*argv, path_of(where, kind)])
    line = assert_one_error_line(rc, out, err)
    if kind not in ("long", "esc", "newline"):
        assert path_of(where, kind) in line, "the error names the path"


def test_a_job_number_past_the_sweeps_end_is_refused_naming_its_count(where: dict[str, str]) -> None:
    """``status 1/42`` of a one-job sweep printed an empty table with exit 0, and ``cancel 1/42``
    said "every job has already ended"."""
    sweep = where["sweep"]
    for command in ("status", "cancel", "logs", "show"):
        line = assert_one_error_line(*call_cli([command, f"{sweep}/42", "--registry", where["registry"]]))
        assert line == (f"switchyard {command}: error: sweep {sweep} has no job 42: it has 1 job "
                        f"({sweep}/0; switchyard status {sweep} --registry {where['registry']} lists them)")
    out = io.StringIO()
    with Registry(where["registry"]) as reg:
        assert cmd_status(reg, f"{sweep}/0", as_json=False, out=out) == 0
    assert f"{sweep}/0" in out.getvalue()


def test_prune_refuses_a_store_that_does_not_exist_or_is_not_one(where: dict[str, str]) -> None:
    """``snapshots prune --store /nonexistent`` said ``removed 0 snapshot(s)`` and exited 0."""
    line = assert_one_error_line(*call_cli(["snapshots", "prune", "--store", where["missing"],
                                            "--registry", where["registry"]]))
    assert f"'{where['missing']}' does not exist (give a snapshot store)" in line
    line = assert_one_error_line(*call_cli(["snapshots", "prune", "--store", where["not_a_store"],
                                            "--registry", where["registry"]]))
    assert "is not a snapshot store: none of its 1 entries is a snapshot" in line
    assert (Path(where["not_a_store"]) / "notes.txt").exists()
    out = io.StringIO()
    with Registry(where["registry"]) as reg:  # an empty store is a store
        assert cmd_prune(reg, where["store"], 30, dry_run=False, as_json=False, out=out) == 0
    assert "removed 0 snapshot(s)" in out.getvalue()


def test_switchyard_itself_exits_2_with_one_line(where: dict[str, str]) -> None:
    proc = subprocess.run([SWITCHYARD, "status", f"{where['sweep']}/42", "--registry", where["registry"]],
                          capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)
    proc = subprocess.run([SWITCHYARD, "status", "--registry", where["registry"], f"--bogus{ESC}"],
                          capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)


# ------------------------------------------------------------------------------------------------
# python -m jobs.train, switchyard run: overrides


def train_error(tmp_path: Path, override: str) -> str:
    """The line ``python -m jobs.train OVERRIDE`` prints before anything is submitted."""
    from jobs import train

    if refused := entry.refuse_argv(["jobs.train", override]):
        return f"error: {refused}"
    try:
        with initialize_config_module("conf", version_base="1.3"):
            composed = compose("train", overrides=[f"data.cache_dir={tmp_path / 'cache'}", override])
        cfg = train.load_config(composed)
        train.check_before_submit(cfg, tmp_path / "run")
    except HydraException as e:
        return f"error: {entry.describe(e)}"
    except ConfigError as e:
        return f"error: {one_line(e)}"
    pytest.fail(f"{override[:80]!r} was accepted")


TRAIN_OVERRIDES = {
    **{f"{key}={name}": f"{key}={value}" for key in ("seed", "optim.max_steps", "parallelism.nodes",
                                                     "data.batch_size", "checkpoint.keep_last")
       for name, value in (("huge", HUGE), ("negative", "-1"))},
    "optim.max_steps=0": "optim.max_steps=0", "parallelism.nodes=0": "parallelism.nodes=0",
    "dollar": "optim.lr=${", "no-such-key-interpolation": "optim.lr=${oops}", "esc": f"data.path={ESC}",
    "newline": "data.path=a\nb", "long-path": f"data.path={LONG}", "long-key": f"{LONG}=1",
    "unknown-key": "optim.lrr=1", "unknown-group": "model=nope", "missing-path": "data.path=/nonexistent",
    "path-under-file": "data.path={under_file}", "fifo-path": "data.path={fifo}",
    "checkpoint.dir-under-file": "checkpoint.dir={under_file}",
    "resume_from-missing": "checkpoint.resume_from={missing}",
    "model.hidden_dim=-1": "model.hidden_dim=-1", "model.hidden_dim=1e11": "model.hidden_dim=100000000000",
    **{f"data.{key}=1e11": f"data.{key}=100000000000"
       for key in ("demo_num_samples", "demo_features", "demo_classes", "demo_max_rows")},
    "data.batch_size=1e11": "data.batch_size=100000000000",
}


@pytest.mark.parametrize("override", TRAIN_OVERRIDES.values(), ids=TRAIN_OVERRIDES.keys())
def test_a_wrong_override_of_jobs_train_is_one_error_line(where: dict[str, str], tmp_path: Path,
                                                          override: str) -> None:
    line = train_error(tmp_path, fill(override, where))
    assert len(line.splitlines()) == 1 and "\x1b" not in line and "Traceback" not in line, line


def test_the_same_checks_pass_a_valid_override(tmp_path: Path) -> None:
    """The sweep above cannot pass by refusing everything: the defaults and a sane override go through."""
    with pytest.raises(pytest.fail.Exception, match="was accepted"):
        train_error(tmp_path, "seed=7")


def test_jobs_train_itself_exits_2_with_one_line(where: dict[str, str], tmp_path: Path) -> None:
    """Hydra's own errors (here: a run directory under a file) were several lines and exit 1."""
    proc = run_train(f"hydra.run.dir={where['under_file']}", timeout=300, cwd=tmp_path)
    line = assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert line == (f"error: cannot create the run directory '{where['under_file']}': Not a directory (try "
                    f"hydra.run.dir=<a directory you can write>, or hydra.sweep.dir= with -m)")


@pytest.mark.parametrize("override", ["optim.lr=${", f"cwd={ESC}", "seed=x\ny", f"{LONG}=1"],
                         ids=["dollar", "esc", "newline", "long-key"])
def test_a_wrong_override_of_switchyard_run_is_one_error_line(override: str) -> None:
    assert_one_error_line(*call_cli(["run", override, "--", "true"]))


def test_switchyard_run_itself_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([SWITCHYARD, "run", "parallelism.nodez=2", "--", "true"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    line = assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert "parallelism.nodez" in line


# ------------------------------------------------------------------------------------------------
# python -m jobs.prepare


def prepare_error(tmp_path: Path, *overrides: str) -> str:
    from jobs import prepare

    if refused := entry.refuse_argv(["jobs.prepare", *overrides]):
        return f"jobs.prepare: error: {refused}"
    try:
        with initialize_config_module("conf", version_base="1.3"):
            composed = compose("prepare", overrides=list(overrides))
        prepare.prepare(prepare.to_config(composed))
    except HydraException as e:
        return f"jobs.prepare: error: {entry.describe(e)}"
    except (ConfigError, DatasetError, OSError) as e:
        return f"jobs.prepare: error: {one_line(e)}"
    pytest.fail(f"{overrides} was accepted")


@pytest.fixture(scope="module")
def npy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("npy")
    for i in range(3):
        np.save(path / f"{i}.npy", np.full(4, i, np.float32))
    return path


PREPARE_OVERRIDES = {
    "input-missing": ["input={missing}"], "input-under-file": ["input={under_file}"],
    "input-fifo": ["input={fifo}"], "input-long": [f"input={LONG}"], "input-esc": [f"input={ESC}"],
    "input-newline": ["input=a\nb"], "input-dollar": ["input=${"],
    "output-under-file": ["input={npy}", "output={under_file}"],
    "output-long": ["input={npy}", f"output={LONG}"],
    "shard_bytes-huge": ["input={npy}", "output={root}/out", f"shard_bytes={HUGE}"],
    "shard_bytes-negative": ["input={npy}", "output={root}/out", "shard_bytes=-1"],
    "num_workers-huge": ["input={npy}", "output={root}/out", f"num_workers={HUGE}"],
}


@pytest.mark.parametrize("overrides", PREPARE_OVERRIDES.values(), ids=PREPARE_OVERRIDES.keys())
def test_a_wrong_override_of_jobs_prepare_is_one_error_line(where: dict[str, str], npy_dir: Path,
                                                            tmp_path: Path, overrides: list[str]) -> None:
    line = prepare_error(tmp_path, *[fill(o, {**where, 'npy': str(npy_dir)}) for o in overrides])
    assert len(line.splitlines()) == 1 and "\x1b" not in line and "Traceback" not in line, line
    assert not (Path(where["root"]) / "out").exists(), "nothing is published"


def test_prepare_accepts_a_valid_input(npy_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match="was accepted"):
        prepare_error(tmp_path, f"input={npy_dir}", f"output={tmp_path / 'out'}")
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_jobs_prepare_itself_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "jobs.prepare", "input=${", f"output={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    line = assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert line.startswith("jobs.prepare: error: the override 'input=${' cannot be parsed")


def test_a_batch_beyond_the_hosts_memory_is_refused_by_the_memory_estimate(tmp_path: Path) -> None:
    """It was a MemoryError traceback: the estimate built the batch as a real tensor. Now the
    estimate's batch is fake, and a CPU step above all of the host's memory per rank is refused."""
    line = train_error(tmp_path, "data.batch_size=100000000000")
    assert line.startswith("error: memory: the estimated peak is ") and "data.batch_size below 100000000000" \
        in line, line
