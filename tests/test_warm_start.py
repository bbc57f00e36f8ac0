"""The warm start of ``python -m jobs.train`` for tests (``tests/warm_start.py``): what a test reads
from a forked process is what it would read from a new one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import warm_start
from train_helpers import train_command


def cold(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(train_command(*args), capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


def test_a_warm_process_prints_and_exits_as_a_new_one(tmp_path: Path) -> None:
    for args in (["--cfg", "job", "optim.lr=0.01"], ["optim.lr=nan"], ["no_such_key=1"]):
        warm = warm_start.run_module("jobs.train", args, cwd=tmp_path)
        new = cold(*args, cwd=tmp_path)
        assert (warm.returncode, warm.stdout, warm.stderr) == (new.returncode, new.stdout, new.stderr), args


def test_a_warm_process_has_the_tests_directory_and_environment(tmp_path: Path) -> None:
    """Hydra's runtime section names the working directory; a variable the zygote never had is the
    test's (and one the worker has since dropped is gone)."""
    env = {**os.environ, "SWITCHYARD_PROBE": "from the test"}
    args = ["--cfg", "all", "--resolve", "+probe=${oc.env:SWITCHYARD_PROBE,unset}"]
    warm = warm_start.run_module("jobs.train", args, cwd=tmp_path, env=env)
    assert warm.returncode == 0, warm.stderr
    assert f"cwd: {tmp_path}" in warm.stdout and "probe: from the test" in warm.stdout
    assert "probe: unset" in warm_start.run_module("jobs.train", args, cwd=tmp_path).stdout


def test_a_variable_read_at_import_starts_a_new_process(tmp_path: Path) -> None:
    """A torch on PYTHONPATH that is too old: only a new interpreter imports it, and refuses it."""
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "2.2.0"\n')
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = warm_start.run_module("jobs.train", [], cwd=tmp_path, env=env, timeout=120)
    assert done.returncode != 0 and "torch 2.2.0 is installed" in done.stderr


def test_a_folder_put_before_the_path_is_imported_from_in_a_warm_process(tmp_path: Path) -> None:
    """A test's own model on PYTHONPATH: the child puts the folder where the interpreter would, so
    the job imports the model, and the process is still a fork (its CPU comes back from the zygote)."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "probe_model.py").write_text("from jobs.models import RowPoolingMLP\n\n\n"
                                         "class Net(RowPoolingMLP):\n    pass\n")
    base = warm_start.Zygote.base_env()  # only PYTHONPATH differs, whatever earlier tests left behind
    env = {**base, "PYTHONPATH": os.pathsep.join(p for p in (str(extra), base.get("PYTHONPATH")) if p)}
    forked_before = warm_start.forked_cpu_s()
    done = warm_start.run_module("jobs.train", [
        "cluster=debug", "model=custom", "model._target_=probe_model.Net", "optim.max_steps=1",
        "memory.estimate=off", "telemetry.enabled=false", "logger.tensorboard=false",
        "data.demo_num_samples=256",
        f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert forked_before < warm_start.forked_cpu_s(), "started cold: the folder was refused"


def test_a_zygote_that_does_not_answer_costs_a_cold_start_not_the_test(tmp_path: Path) -> None:
    """Its socket gone (a zygote killed, say): the run starts cold, and the next one a new zygote."""
    zygote = warm_start._zygote()
    assert zygote is not None
    zygote.path = str(tmp_path / "no-socket")
    # The zygote's own environment, so the run asks it (whatever earlier tests left in os.environ).
    done = warm_start.run_module("jobs.train", ["optim.lr=nan"], cwd=tmp_path,
                                 env=warm_start.Zygote.base_env())
    assert done.returncode == 2 and done.stderr.startswith("error: optim.lr=nan is invalid")
    zygote.process.wait(timeout=30)
    assert warm_start._zygote() is not zygote


def test_a_folder_shadows_only_what_a_new_interpreter_would_import_from_it(tmp_path: Path) -> None:
    """tests/ on PYTHONPATH holds folders named orchestrator, jobs and sharding: started in the
    project's folder, ``python -m`` finds the project's packages there first, so a new interpreter
    imports the same modules as the zygote, and the run may stay warm. Anywhere else, or for a
    module the working directory does not hold, the folder's may be imported instead."""
    import orchestrator

    repo = str(Path(orchestrator.__file__).parents[1])
    imported = {"orchestrator": os.path.realpath(orchestrator.__file__), "hydra_plugins": None}
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "usercode").mkdir()
    assert not warm_start.Zygote.shadows(str(tmp_path), imported, cwd=repo)
    found = subprocess.run([sys.executable, "-c", "import orchestrator; print(orchestrator.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=repo,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.realpath(found) == imported["orchestrator"]  # what the rule stands on
    assert warm_start.Zygote.shadows(str(tmp_path), imported, cwd=str(tmp_path / "usercode"))
    (tmp_path / "hydra_plugins").mkdir()
    assert warm_start.Zygote.shadows(str(tmp_path), imported, cwd=repo)


def test_a_namespace_folder_loses_to_a_module_on_the_path(tmp_path: Path) -> None:
    """The project's folder holds the docs build's site/, named like the standard library's
    ``site``: a directory without ``__init__.py`` loses to a module found anywhere on the path, so
    it stays warm; a site.py there would be imported instead."""
    import site

    imported = {"site": os.path.realpath(site.__file__)}
    search = {os.path.dirname(os.path.realpath(site.__file__))}
    (tmp_path / "site").mkdir()
    assert not warm_start.Zygote.shadows(str(tmp_path), imported, cwd=str(tmp_path), search=search)
    assert warm_start.Zygote.shadows(str(tmp_path), imported, cwd=str(tmp_path), search=())
    (tmp_path / "site.py").write_text("")
    assert warm_start.Zygote.shadows(str(tmp_path), imported, cwd=str(tmp_path), search=search)
