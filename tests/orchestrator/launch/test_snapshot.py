"""The code snapshot store: content-addressed, deduplicated, atomic, excludes, size refusal; and the
provenance compared at resume."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, SnapshotConfig
from orchestrator.launch import provenance, snapshot, submit


def user_package(root: Path, body: str = "X = 1\n") -> Path:
    pkg = root / "snap_user_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(body)
    (pkg / "data" / "big.bin").write_bytes(b"0" * 1000)  # a data folder, not a package: excluded
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "models.cpython-311.pyc").write_bytes(b"stale")
    (pkg / ".git").mkdir()
    (pkg / ".git" / "HEAD").write_text("ref")
    return pkg


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[Path]:
    src = tmp_path / "src"
    src.mkdir()
    sys.path.insert(0, str(src))
    yield src
    sys.path.remove(str(src))


def config(tmp_path: Path, **kwargs: object) -> SnapshotConfig:
    return SnapshotConfig(dir=str(tmp_path / "store"), **kwargs)  # type: ignore[arg-type]


def test_holds_own_packages_and_the_user_target_without_excluded_files(tmp_path: Path, on_path: Path) -> None:
    user_package(on_path)
    snap = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert snap.created and snap.path.parent == tmp_path / "store"
    assert (snap.path / "snap_user_pkg" / "models.py").read_text() == "X = 1\n"
    assert (snap.path / "orchestrator" / "launch" / "snapshot.py").is_file()
    assert (snap.path / "jobs" / "models.py").is_file()
    files = set(snap.files)
    assert not [f for f in files if "__pycache__" in f or ".git/" in f]
    assert "snap_user_pkg/data/big.bin" not in files
    assert snapshot.read_manifest(snap.path) == snap.files


def test_every_module_is_compiled_once_into_the_snapshot(tmp_path: Path, on_path: Path) -> None:
    """Ranks import bytecode compiled at publication, never compile (PYTHONDONTWRITEBYTECODE, or a
    store they cannot write) nor race to write ``__pycache__`` into a published snapshot. The user's
    stale ``.pyc`` is not copied: the snapshot's is compiled from the copied source."""
    user_package(on_path)
    snap = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    sources = list(snap.path.rglob("*.py"))
    assert len(sources) > 50
    for source in sources:
        compiled = Path(importlib.util.cache_from_source(str(source)))
        flags = int.from_bytes(compiled.read_bytes()[4:8], "little")
        assert flags == 0b01, f"{compiled}: not an unchecked hash-based pyc"  # immutable source
    stale = snap.path / "snap_user_pkg" / "__pycache__" / "models.cpython-311.pyc"
    assert not stale.exists() or stale.read_bytes() != b"stale"


def test_a_package_named_like_an_exclude_is_kept(tmp_path: Path, on_path: Path) -> None:
    pkg = user_package(on_path)
    (pkg / "data" / "__init__.py").write_text("LOADER = 1\n")
    snap = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert "snap_user_pkg/data/__init__.py" in snap.files


def test_unchanged_code_is_stored_once_and_an_edit_is_a_new_snapshot(tmp_path: Path, on_path: Path) -> None:
    pkg = user_package(on_path)
    first = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    again = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert again.hash == first.hash and not again.created
    assert len(list((tmp_path / "store").iterdir())) == 1
    (pkg / "models.py").write_text("X = 2\n")
    edited = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert edited.hash != first.hash
    assert snapshot.changed_files(first.files, edited.files) == ["snap_user_pkg/models.py"]
    assert (first.path / "snap_user_pkg" / "models.py").read_text() == "X = 1\n"  # never rewritten


def test_a_half_written_snapshot_is_never_used(tmp_path: Path, on_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    user_package(on_path)
    calls = {"n": 0}
    real_copy = snapshot.shutil.copy2

    def dying_copy(src: object, dst: object) -> object:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")
        return real_copy(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshot.shutil, "copy2", dying_copy)
    with pytest.raises(OSError, match="No space"):
        snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert list((tmp_path / "store").iterdir()) == []  # no hash-named directory, no temp left
    monkeypatch.setattr(snapshot.shutil, "copy2", real_copy)
    snap = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert snap.created and snapshot.read_manifest(snap.path) == snap.files


def test_a_leftover_temp_directory_is_not_a_snapshot(tmp_path: Path, on_path: Path) -> None:
    user_package(on_path)
    store = tmp_path / "store"
    (store / ".tmp-killed-copy").mkdir(parents=True)  # a submission killed mid-copy
    snap = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    assert snap.created and snap.path.name == snap.hash


def test_an_oversized_snapshot_is_refused_naming_the_largest_files(tmp_path: Path, on_path: Path) -> None:
    pkg = user_package(on_path)
    (pkg / "weights.npy").write_bytes(os.urandom(3 * 2**20))
    largest = r"over cluster.snapshot.max_mb=2.*snap_user_pkg/weights.npy \(3.0 MiB\)"
    with pytest.raises(ConfigError, match=largest):
        snapshot.take(config(tmp_path, max_mb=2.0), ["snap_user_pkg.models.Net"])
    assert not (tmp_path / "store").exists()


def test_include_and_missing_include(tmp_path: Path) -> None:
    extra = tmp_path / "helpers"
    extra.mkdir()
    (extra / "util.py").write_text("Y = 1\n")
    snap = snapshot.take(config(tmp_path, include=[str(extra)]))
    assert snap.files["helpers/util.py"]
    with pytest.raises(ConfigError, match=r"cluster.snapshot.include\[0\]=.*no such file"):
        snapshot.take(config(tmp_path, include=[str(tmp_path / "nope")]))


def test_installed_targets_are_not_copied() -> None:
    assert snapshot.module_source("torch.nn.Linear") is None  # site-packages: its version is recorded
    assert snapshot.module_source("json.JSONDecoder") is None  # the standard library


def test_max_mb_must_be_positive() -> None:
    with pytest.raises(ConfigError, match=r"cluster.snapshot.max_mb=0.0 is invalid"):
        SnapshotConfig(max_mb=0.0)


def test_resume_change_names_the_files_and_torch(tmp_path: Path, on_path: Path) -> None:
    pkg = user_package(on_path)
    old = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    (pkg / "models.py").write_text("X = 3\n")
    new = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    saved = {"code_hash": old.hash, "snapshot": str(old.path), "torch": "2.12.0"}
    now = {"code_hash": new.hash, "snapshot": str(new.path), "torch": "2.13.0"}
    change = provenance.resume_change(saved, now)
    assert change is not None and change["files"] == ["snap_user_pkg/models.py"]
    text = provenance.describe_change(change)
    assert "snap_user_pkg/models.py" in text and "torch 2.12.0 -> 2.13.0" in text
    assert provenance.resume_change(saved, dict(saved)) is None
    assert provenance.resume_change(None, now) is None  # a checkpoint from before provenance


def test_setup_lines_put_the_snapshot_first(tmp_path: Path) -> None:
    snap = snapshot.take(config(tmp_path))
    lines = snapshot.setup_lines(snap)
    # the check that the snapshot is whole, in the batch script's own shell
    assert lines[0].startswith(f"(\nroot={snap.path}\n") and lines[0].endswith("\n) || exit 1")
    assert lines[1].startswith(f"export PYTHONPATH={snap.path}")
    assert "export PYTHONSAFEPATH=1" in lines


def test_provenance_records_the_installed_packages_the_users_code_imports(tmp_path: Path,
                                                                          on_path: Path) -> None:
    """numpy by its own name, PyYAML through the module it provides (yaml); the standard library,
    Switchyard, the user's own modules and a name nothing installs are left out."""
    user_package(on_path, "import os, json\nimport numpy as np\nfrom yaml import safe_load\n"
                          "from orchestrator import config\nfrom . import helpers\n"
                          "import snap_user_pkg.data\nimport not_installed_anywhere\n")
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "tools.py").write_text("    import hypothesis.strategies  # indented: inside a function\n")
    found = provenance.user_packages(config(tmp_path, include=[str(extra)]), ["snap_user_pkg.models.Net"])
    assert found == {"numpy": importlib.metadata.version("numpy"),
                     "PyYAML": importlib.metadata.version("PyYAML"),
                     "hypothesis": importlib.metadata.version("hypothesis")}
    provenance.record(tmp_path / "run", None, "a: 1\n", provenance.origin(packages=found), None)
    data = provenance.read(tmp_path / "run")
    assert data is not None and data["packages"] == found
    assert provenance.lines(data)[-1] == "packages: " + ", ".join(f"{k} {v}" for k, v in found.items())
    assert provenance.for_checkpoint(tmp_path / "run")["packages"] == found  # this process's versions


def test_a_resume_under_another_version_of_a_users_package_names_it(tmp_path: Path) -> None:
    numpy_now = importlib.metadata.version("numpy")
    saved = {"code_hash": None, "torch": provenance.versions()["torch"],
             "packages": {"numpy": "1.0.0", "hypothesis": importlib.metadata.version("hypothesis"),
                          "gone-since-pkg": "2.0"}}
    change = provenance.resume_change(saved, provenance.for_checkpoint())
    assert change == {"packages": {"gone-since-pkg": ["2.0", None], "numpy": ["1.0.0", numpy_now]}}
    text = provenance.describe_change(change)
    assert f"package numpy 1.0.0 -> {numpy_now}" in text
    assert "package gone-since-pkg 2.0 -> (not installed)" in text
    saved["packages"] = {"numpy": numpy_now}
    assert provenance.resume_change(saved, provenance.for_checkpoint()) is None


def test_import_names_are_read_from_source_text() -> None:
    text = ("import a.b as c, d\nfrom e.f import g\nfrom . import h\nfrom .i import j\n"
            "# import k\nx = 'import l'\n    import m  # m\nimportlib = 1\n")
    assert provenance.imported_names(text) == {"a", "d", "e", "m"}


# Files that raise on read even for root (the tests run as root: chmod 000 stops nothing): the
# process's own memory at address 0 (EIO), and a write-only sysfs attribute (EACCES).
UNREADABLE = [("/proc/self/mem", "Input/output error"), ("/sys/bus/pci/rescan", "Permission denied")]


@pytest.mark.parametrize(("target", "why"), UNREADABLE)
def test_an_unreadable_file_in_the_snapshot_is_one_error_naming_it(tmp_path: Path, target: str,
                                                                    why: str) -> None:
    """The issue: a raw OSError traceback, not a SnapshotError, and the file not named."""
    if not os.path.exists(target):
        pytest.skip(f"{target} does not exist here")
    extra = tmp_path / "helpers"
    extra.mkdir()
    (extra / "util.py").write_text("Y = 1\n")
    (extra / "weights.bin").symlink_to(target)
    with pytest.raises(snapshot.SnapshotError) as refused:
        snapshot.take(config(tmp_path, include=[str(extra)]))
    assert str(refused.value) == (
        f"cannot read {extra / 'weights.bin'} for the code snapshot: {why}. Make it readable, or leave "
        f"it out (add 'weights.bin' to cluster.snapshot.exclude=[...]), or turn snapshots off "
        f"(cluster.snapshot.enabled=false)")
    assert not (tmp_path / "store").exists() or not list((tmp_path / "store").iterdir())
    snap = snapshot.take(config(tmp_path, include=[str(extra)], exclude=["weights.bin"]))
    assert "helpers/util.py" in snap.files


def job_script(snap: snapshot.Snapshot) -> subprocess.CompletedProcess[str]:
    """What the sbatch script runs before srun, then a stand-in for the ranks."""
    script = "\n".join([*snapshot.setup_lines(snap), "echo the ranks ran"])
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_a_job_whose_snapshot_is_gone_or_incomplete_stops_before_any_code_runs(
        tmp_path: Path, on_path: Path) -> None:
    """The issue: a snapshot deleted while its job waited; the job ran the working tree (the job's
    directory ends PYTHONPATH), and its checkpoints named the snapshot's code hash. The deletion on
    the real cluster: tests/slurm/test_snapshot_on_slurm.py."""
    user_package(on_path)
    snap = snapshot.take(config(tmp_path), ["snap_user_pkg.models.Net"])
    whole = job_script(snap)
    assert whole.returncode == 0 and whole.stdout == "the ranks ran\n", whole.stderr
    (snap.path / "snap_user_pkg" / "models.py").unlink()
    (snap.path / "orchestrator" / "cli.py").unlink()
    incomplete = job_script(snap)
    assert incomplete.returncode == 1 and incomplete.stdout == ""
    assert incomplete.stderr == (
        f"error: the code snapshot {snap.path} of this job is incomplete (orchestrator/cli.py and 1 more "
        f"gone): it was deleted after the job was submitted, so the job stops before running your "
        f"code. Resubmit the job (a new snapshot is taken), or submit with "
        f"cluster.snapshot.enabled=false to run the working tree\n")
    shutil.rmtree(snap.path)
    missing = job_script(snap)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr == f"error: {snapshot.gone_line(snap.path)}\n"
    assert "of this job is missing" in missing.stderr


@pytest.fixture
def named_snapshot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SWITCHYARD_SNAPSHOT as the job's script sets it, for this process (``snapshot.current``
    caches it)."""
    snapshot.current.cache_clear()
    yield
    monkeypatch.delenv(snapshot.SNAPSHOT_ENV, raising=False)
    snapshot.current.cache_clear()


def test_a_rank_whose_snapshot_is_gone_stops_naming_it(tmp_path: Path, named_snapshot: None,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleted after the job's script checked it: the rank stops before the job's function runs."""
    gone = tmp_path / "store" / ("0" * 64)
    monkeypatch.setenv(snapshot.SNAPSHOT_ENV, str(gone))
    called = []
    with pytest.raises(submit.RankFailed, match=rf"the code snapshot {gone} of this job is missing: .* "
                                                r"cluster.snapshot.enabled=false"):
        submit.rank_entry(lambda: called.append(1))()
    assert called == []


def test_a_checkpoint_names_only_the_snapshot_its_code_came_from(tmp_path: Path, named_snapshot: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """This process imports the checkout, not the snapshot SWITCHYARD_SNAPSHOT names: its
    checkpoints recorded that snapshot's hash, so a resume under other code passed as the same."""
    snap = snapshot.take(config(tmp_path))
    monkeypatch.setenv(snapshot.SNAPSHOT_ENV, str(snap.path))
    recorded = provenance.for_checkpoint()
    assert recorded["code_hash"] is None and recorded["snapshot"] is None
