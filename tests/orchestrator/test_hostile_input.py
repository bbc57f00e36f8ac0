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
import shutil
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
    "cluster.timeout_min=1e11": "cluster.timeout_min=99999999999", "empty-job-name": "cluster.job_name=",
    "model.hidden_dim=0": "model.hidden_dim=0",
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


# The command after `--`: it is the config's ``command``, where ``${key}`` resolves.
COMMANDS = {"dollar": ["echo", "${"], "dollar-inside": ["python", "x.py", "--lr=${lr"],
            "dollar-after-one": ["echo", "${cwd}${"], "esc": ["echo", ESC],
            "no-such-key": ["echo", "${oops}"], "nothing": [], "missing-program": ["/nonexistent/prog"]}


@pytest.mark.parametrize("command", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_wrong_command_of_switchyard_run_is_one_error_line(command: list[str], tmp_path: Path) -> None:
    """An unfinished ``${`` after `--` was an omegaconf GrammarParseError traceback with exit 1."""
    line = assert_one_error_line(*call_cli(["run", f"hydra.run.dir={tmp_path / 'run'}", "--", *command]))
    assert not (tmp_path / "run" / "command.sh").exists(), "nothing was submitted"
    if command[-1:] and "${" in command[-1] and command[-1] != "${oops}":
        assert line.startswith(f"switchyard run: error: argument {len(command)} of the command after `--` "
                               f"({command[-1]!r}) has an unfinished ${{...}}"), line
        assert "write \\${ for a literal ${" in line, line


def test_switchyard_run_itself_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = subprocess.run([SWITCHYARD, "run", "parallelism.nodez=2", "--", "true"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    line = assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert "parallelism.nodez" in line
    proc = subprocess.run([SWITCHYARD, "run", "--", "echo", "${"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    line = assert_one_error_line(proc.returncode, proc.stdout, proc.stderr)
    assert line == ("switchyard run: error: argument 2 of the command after `--` ('${') has an unfinished "
                    "${...}: a ${key} there is resolved from the config, so close it (${key}), or write "
                    "\\${ for a literal ${ (try '\\${')")


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


# ------------------------------------------------------------------------------------------------
# Container paths (cluster=slurm container=apptainer): every path the job mounts, refused before
# anything is queued. Kept apart from the overrides above: this goes as far as the executor's
# script (``submit.make_executor``, where the mounts are decided), in a dry run.


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A submitting directory, an image, and paths that cannot be mounted as they are named:
    directories whose names hold the mount lists' separators, and symlinks that lead to them
    from inside the submitting directory (so only following the link finds the trouble)."""
    from jobs.demo_data import ensure_demo_dataset
    from orchestrator.config import DataConfig

    root = tmp_path_factory.mktemp("box")
    code, outside = root / "code", root / "outside"
    for d in (code, root / "src"):
        d.mkdir(parents=True)
    train, _ = ensure_demo_dataset(DataConfig(cache_dir=str(root / "cache")))
    for name in ("a,b", "a:b", "clean"):  # a dataset in each, so data.path is refused for its name only
        shutil.copytree(train, outside / name)
    (root / "torch.sif").write_bytes(b"sif")
    (code / "to-comma").symlink_to(outside / "a,b")
    (code / "to-colon").symlink_to(outside / "a:b")
    (root / "dangling.sif").symlink_to(root / "gone.sif")
    return {"root": str(root), "code": str(code), "out": str(outside), "image": str(root / "torch.sif"),
            "src": str(root / "src"), "run": str(code / "run")}


def container_error(box: dict[str, str], *overrides: str, run_dir: str | None = None) -> str:
    """The line ``python -m jobs.train cluster=slurm container=apptainer cluster.dry_run=true
    OVERRIDES`` prints before it would queue anything (run from the box's submitting directory)."""
    from jobs import train
    from orchestrator.launch import submit

    run = Path(run_dir if run_dir is not None else box["run"])
    defaults = ["cluster=slurm", "container=apptainer", "cluster.dry_run=true",
                f"cluster.container.image={box['image']}", f"data.cache_dir={box['root']}/cache",
                "memory.estimate=off"]
    try:
        with initialize_config_module("conf", version_base="1.3"):
            composed = compose("train", overrides=[*defaults, *overrides])
        cfg = train.load_config(composed)
        paths, _ = train.check_before_submit(cfg, run)
        submit.make_executor(cfg.cluster, cfg.parallelism, run / "submitit", None,
                             train.container_paths(cfg, paths, run))
    except HydraException as e:
        return f"error: {entry.describe(e)}"
    except ConfigError as e:
        return f"error: {one_line(e)}"
    pytest.fail(f"{overrides} (run directory {run}) was accepted")


SPLIT = "reads as separators"  # the mount lists' SRC:DST,... would split the path on the node
# id -> (override, what the error says)
CONTAINER_PATHS = {
    **{f"{key}-{kind}": (f"{key}='{{out}}/{name}'", SPLIT) for key in ("data.path", "checkpoint.dir")
       for kind, name in (("comma", "a,b"), ("colon", "a:b"), ("dots", "clean/../a,b"))},
    **{f"{key}-symlink-{kind}": (f"{key}={{code}}/to-{kind}", f"leads through a symlink: {{out}}/a{sep}b")
       for key in ("data.path", "checkpoint.dir") for kind, sep in (("comma", ","), ("colon", ":"))},
    "data.path-empty": ("data.path=", "no dataset there"),
    "checkpoint.dir-empty": ("checkpoint.dir=", "an empty path names nothing"),
    "checkpoint.resume_from-empty": ("checkpoint.resume_from=", "an empty path names nothing"),
    "mounts-comma": ("cluster.container.mounts=['{src},{out}/clean:/x']", "separates mounts"),
    "mounts-colon": ("cluster.container.mounts=[{src}:/x:/y:ro]", "a mount is SRC, SRC:DST or SRC:DST:ro"),
    "mounts-empty": ("cluster.container.mounts=['']", "a mount is SRC, SRC:DST or SRC:DST:ro"),
    "mounts-missing-source": ("cluster.container.mounts=[{root}/gone:/x]", "its source {root}/gone does not"),
    "mounts-relative-target": ("cluster.container.mounts=[{src}:x]", "is not an absolute path"),
    "mounts-target-in-run": ("cluster.container.mounts=[{src}:{run}/submitit]",
                             "its target {run}/submitit lies inside {run} (hydra.run.dir)"),
    "mounts-target-in-run-dots": ("cluster.container.mounts=[{src}:{code}/x/../run/checkpoints]",
                                  "its target {run}/checkpoints lies inside {run} (hydra.run.dir)"),
    "mounts-target-over-run-dots": ("cluster.container.mounts=[{src}:{out}/clean/../../code]",
                                    "its target {code} would hide {run}"),
    "image-empty": ("cluster.container.image=", "none is named"),
    "image-missing-dots": ("cluster.container.image={root}/x/../gone.sif", "no such file"),
    "image-dangling-symlink": ("cluster.container.image={root}/dangling.sif", "no such file"),
    "image-directory": ("cluster.container.image={root}/src.sif", "no such file"),
}
RUN_DIRS = {"run-comma": "{out}/a,b/run", "run-colon": "{out}/a:b/run", "run-dots": "{out}/clean/../a,b/run",
            "run-symlink-comma": "{code}/to-comma/run"}


@pytest.mark.parametrize(("override", "said"), CONTAINER_PATHS.values(), ids=CONTAINER_PATHS.keys())
def test_a_container_path_that_cannot_be_mounted_is_one_error_line(
        box: dict[str, str], override: str, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(box["code"])
    extra = ["data.num_classes=10"] if override.startswith("data.path=") else []  # the demo data's
    line = container_error(box, fill(override, box), *extra)
    assert len(line.splitlines()) == 1 and line.startswith("error: ") and "Traceback" not in line, line
    key = override.split("=", 1)[0]
    assert key in line and fill(said, box) in line, line


@pytest.mark.parametrize("run_dir", RUN_DIRS.values(), ids=RUN_DIRS.keys())
def test_a_run_directory_that_cannot_be_mounted_is_one_error_line(box: dict[str, str], run_dir: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(box["code"])
    line = container_error(box, run_dir=fill(run_dir, box))
    assert len(line.splitlines()) == 1 and line.startswith("error: hydra.run.dir=") and SPLIT in line, line


def test_the_container_paths_sweep_passes_what_can_be_mounted(box: dict[str, str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep above cannot pass by refusing everything: the same paths without a separator, a
    '..' that resolves to one, a symlink out of every mount, and a mount beside the run directory
    go through."""
    monkeypatch.chdir(box["code"])
    (Path(box["code"]) / "to-clean").symlink_to(Path(box["out"]) / "clean")
    with pytest.raises(pytest.fail.Exception, match="was accepted"):
        container_error(box, f"data.path={box['code']}/to-clean", "data.num_classes=10",
                        f"checkpoint.dir='{box['out']}/a,b/../clean/ckpt'",
                        f"cluster.container.mounts=[{box['src']}:"
                        f"{box['run']}/../extra/../beside]", run_dir=f"{box['out']}/clean/run")


def test_switchyard_run_refuses_a_working_directory_it_cannot_mount_in_one_line(
        box: dict[str, str], tmp_path: Path) -> None:
    """The command's working directory (``cwd``) is mounted as jobs.train's paths are."""
    line = assert_one_error_line(*call_cli([
        "run", "cluster=slurm", "container=apptainer", f"cluster.container.image={box['image']}",
        "cluster.dry_run=true", "cluster.snapshot.enabled=false", f"hydra.run.dir={tmp_path / 'run'}",
        f"cwd='{box['out']}/a,b'", "--", "true"]))
    assert f"cwd='{box['out']}/a,b' is invalid: it holds ','" in line and SPLIT in line, line


def test_jobs_train_itself_refuses_a_container_path_with_exit_2_and_one_line(box: dict[str, str]) -> None:
    proc = run_train("cluster=slurm", "container=apptainer", f"cluster.container.image={box['image']}",
                     "cluster.dry_run=true", "memory.estimate=off", f"checkpoint.dir='{box['out']}/a:b'",
                     f"data.cache_dir={box['root']}/cache", f"hydra.run.dir={box['run']}",
                     cwd=Path(box["code"]))
    line = assert_one_error_line(proc.returncode, proc.stdout.replace(f"run_dir: {box['run']}\n", ""),
                                 proc.stderr)
    assert line.startswith(f"error: checkpoint.dir='{box['out']}/a:b' is invalid: it holds ':'"), line
    assert not (Path(box["run"]) / "submitit").exists() or not any((Path(box["run"]) / "submitit").iterdir())
