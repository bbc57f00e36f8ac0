"""The code snapshot store: content-addressed, deduplicated, atomic, excludes, size refusal; and the
provenance compared at resume."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, SnapshotConfig
from orchestrator.launch import provenance, snapshot


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
    assert lines[0].startswith(f"export PYTHONPATH={snap.path}")
    assert "export PYTHONSAFEPATH=1" in lines
