"""What a run ran: the code snapshot, the git commit and its diff, the config's hash, the versions.

Written at submission into the run directory (``provenance.json``, the diff beside it as
``provenance.diff``), shown by ``switchyard show``. A checkpoint records the part a resume must
share (``for_checkpoint``: the snapshot's hash, torch's version and the versions of the installed
packages the user's code imports); ``resume_change`` says what
differs when a run continues from a checkpoint written under other code.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from durable import atomic
from orchestrator.config import ClusterConfig, SnapshotConfig
from orchestrator.launch import container, snapshot

PROVENANCE_FILE = "provenance.json"
DIFF_FILE = "provenance.diff"
_GIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Origin:
    """What the submitting side sees once per submission (a sweep's points share it)."""

    git_commit: str | None  # None: not a git checkout, or git is not installed
    git_dirty: bool | None
    git_diff: str  # `git diff HEAD`: tracked files' uncommitted changes
    versions: dict[str, str | None]
    packages: dict[str, str]  # installed distributions the user's own code imports -> version


def _git(cwd: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=_GIT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def versions() -> dict[str, str | None]:
    """Python, torch, CUDA and NCCL as this process has them (CUDA/NCCL only once torch is
    imported: a `switchyard run` submission never imports it)."""
    found: dict[str, str | None] = {"python": platform.python_version(), "torch": None,
                                    "cuda": None, "nccl": None}
    torch = sys.modules.get("torch")
    if torch is not None:
        found["torch"] = str(torch.__version__)
        found["cuda"] = torch.version.cuda
        try:
            nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        except (RuntimeError, AttributeError):
            nccl = None
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl and str(nccl)
    else:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found["torch"] = importlib.metadata.version("torch")
    return found


# ``import a.b, c`` and ``from a.b import c`` at any indentation: the top-level name is what maps
# to an installed distribution. A regex, not ast: it runs on every submission, over every file.
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+([A-Za-z_]\w*)[\w.]*[ \t]+import\b|import[ \t]+([^#;\n]+))",
                     re.MULTILINE)


def imported_names(text: str) -> set[str]:
    """The top-level module names a Python source imports (relative imports are its own code)."""
    names = set()
    for from_name, imported in _IMPORT.findall(text):
        if from_name:
            names.add(from_name)
            continue
        for part in imported.split(","):
            name = part.strip().split(" ", 1)[0].split(".", 1)[0]
            if name.isidentifier():
                names.add(name)
    return names


def user_files(config: SnapshotConfig, targets: Sequence[str], scripts: Sequence[Path] = ()
               ) -> Iterable[Path]:
    """The user's own Python files: the target modules, ``cluster.snapshot.include`` and the
    scripts a command runs; what a snapshot excludes is skipped here too."""
    sources = [s for s in map(snapshot.module_source, targets) if s is not None]
    with contextlib.suppress(snapshot.SnapshotError):  # a missing include is refused by the snapshot
        sources += snapshot.include_sources(config.include)
    sources += [snapshot.Source(path, path.name) for path in scripts if path.is_file()]
    for source in sources:
        # A directory it cannot list is refused by the snapshot; without one it is only not read.
        with contextlib.suppress(snapshot.SnapshotError):
            yield from (file for _, file in snapshot.walk(source, config.exclude) if file.suffix == ".py")


def user_packages(config: SnapshotConfig, targets: Sequence[str], scripts: Sequence[Path] = ()
                  ) -> dict[str, str]:
    """Distribution -> version of what the user's code imports that is installed (a target that
    is itself installed, ``timm.models.X``, counts too): the standard library, Switchyard and the
    user's own modules are left out, and so are names installed by no distribution."""
    names = {target.split(".", 1)[0] for target in targets}
    for file in user_files(config, targets, scripts):
        with contextlib.suppress(OSError):
            names |= imported_names(file.read_text(errors="replace"))
    names -= {*sys.stdlib_module_names, *snapshot.OWN_PACKAGES, "__future__"}
    found = {}
    for name in sorted(names):
        dist = _distribution(name)
        if dist is not None:
            found[dist] = importlib.metadata.version(dist)
    return found


def _distribution(name: str) -> str | None:
    """The installed distribution that provides top-level module ``name``; None for a module of
    the user's own (not in site-packages) or one that is not importable here."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or snapshot.module_source(name) is not None:
        return None
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version(name)  # most distributions are named as their module
        return name
    locations = list(spec.submodule_search_locations or [])
    where = Path(locations[0]) if locations else Path(spec.origin or "")
    return _provider(name, where.parent)


def _provider(name: str, site: Path) -> str | None:
    """Which ``*.dist-info`` beside the module lists it (yaml -> PyYAML, sklearn -> scikit-learn).
    importlib's packages_distributions() reads every distribution's file list, 60-170 ms on every
    submission; this reads the likely ones first (the module's name in theirs) and stops at the
    first that lists it."""
    infos = sorted(site.glob("*.dist-info"), key=lambda info: name.lower() not in info.name.lower())
    for info in infos:
        try:
            top = info / "top_level.txt"
            lines = top.read_text() if top.is_file() else (info / "RECORD").read_text()
            listed = {line.split("/", 1)[0].split(".", 1)[0].split(",", 1)[0] for line in lines.splitlines()}
        except OSError:
            continue
        if name in listed:
            return importlib.metadata.Distribution.at(info).metadata["Name"] or None
    return None


def package_versions(names: Iterable[str]) -> dict[str, str | None]:
    """On a rank: this process's version of each distribution (None: not installed here)."""
    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def origin(cwd: Path | None = None, packages: dict[str, str] | None = None) -> Origin:
    """Git state of the working directory's checkout, else of the one Switchyard runs from;
    ``packages``: the user's (``user_packages``)."""
    where = cwd or Path.cwd()
    commit = _git(where, "rev-parse", "HEAD")
    if commit is None:
        where = snapshot.own_root()
        commit = _git(where, "rev-parse", "HEAD")
    status = _git(where, "status", "--porcelain") if commit else None
    diff = (_git(where, "diff", "HEAD") or "") if commit else ""
    return Origin(commit.strip() if commit else None, bool(status.strip()) if status is not None else None,
                  diff, versions(), dict(packages or {}))


def config_hash(config_text: str) -> str:
    return hashlib.sha256(config_text.encode()).hexdigest()


def write_diff(folder: Path, found: Origin) -> Path | None:
    """The uncommitted diff, once per submission; None when the tree is clean."""
    if not found.git_diff:
        return None
    path = folder / DIFF_FILE
    atomic.write_text(path, found.git_diff, durable=False)  # submit-time: resubmitting rewrites it
    return path


def record(run_dir: Path, snap: snapshot.Snapshot | None, config_text: str, found: Origin,
           diff_path: Path | None, image: dict[str, str | None] | None = None) -> dict[str, Any]:
    """``RUN/provenance.json``; returns what it wrote. ``image``: ``container.identity``'s."""
    code = {"hash": snap.hash, "path": str(snap.path), "files": len(snap.files)} if snap else None
    data = {"snapshot": code,
            "git": {"commit": found.git_commit, "dirty": found.git_dirty,
                    "diff": str(diff_path) if diff_path else None},
            "config_sha256": config_hash(config_text), "versions": found.versions,
            "packages": found.packages, "image": image,
            "submitted_at": time.time()}
    atomic.write_text(Path(run_dir) / PROVENANCE_FILE, json.dumps(data, indent=1), durable=False)
    return data


def read(run_dir: str | Path) -> dict[str, Any] | None:
    try:
        data = json.loads((Path(run_dir) / PROVENANCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def lines(data: dict[str, Any]) -> list[str]:
    """What ``switchyard show`` prints of a run's provenance."""
    snap, git, found = data.get("snapshot"), data.get("git") or {}, data.get("versions") or {}
    out = [f"code snapshot: {snap['hash'][:16]} ({snap['path']})" if snap
           else "code snapshot: none (the job imported the working tree)"]
    if git.get("commit"):
        changes = git["diff"] or "untracked files only"
        dirty = f" + uncommitted changes ({changes})" if git.get("dirty") else ""
        out.append(f"git: {git['commit'][:12]}{dirty}")
    out.append(f"config sha256: {str(data.get('config_sha256'))[:16]}")
    out.append("versions: " + ", ".join(f"{k} {v}" for k, v in found.items() if v))
    if data.get("image"):
        out.append(f"image: {container.describe(data['image'])}")
    packages = data.get("packages") or {}
    out.append("packages: " + (", ".join(f"{k} {v}" for k, v in packages.items()) if packages else
                               "none installed that your code imports"))
    return out


def resume_lines(resumed: dict[str, Any]) -> list[str]:
    """What a run that continued from a checkpoint says of it (summary.json's ``resumed_from``),
    the same wherever the user looks: rank 0's log, the submitting terminal, ``switchyard show``.
    The config changes the resume applied (``orchestrator.training.resume.config_changes``) are
    named, not left in rank 0's log alone."""
    out = [f"resumed from {resumed.get('path')} at step {resumed.get('step')}"]
    changes = resumed.get("config_changes") or {}
    if changes:
        out.append("changed at resume, now applied: " + ", ".join(
            f"{key} {old} -> {new}" for key, (old, new) in changes.items()))
    return out


def resumed_from(run_dir: str | Path) -> dict[str, Any] | None:
    """The ``resumed_from`` of a run's summary.json; None when it did not resume (or has not ended)."""
    try:
        found = json.loads((Path(run_dir) / "summary.json").read_text()).get("resumed_from")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) else None


# ------------------------------------------------------------------------------------------------
# At checkpoint and resume (on the ranks)


def for_checkpoint(run_dir: str | Path | None = None) -> dict[str, Any]:
    """The provenance a checkpoint records: the snapshot this rank really imports from (none when
    ``SWITCHYARD_SNAPSHOT`` names one the code did not come from: ``snapshot.running``), torch's
    version, this rank's versions of the user's packages named at submission
    (``RUN/provenance.json`` of ``run_dir``), and the run that wrote it (``run_id``: another run
    resumes it only when told to, ``orchestrator.training.resume``)."""
    snap = snapshot.running()
    submitted = (read(run_dir) or {}) if run_dir is not None else {}
    named = submitted.get("packages") or {}
    return {"code_hash": snap.hash if snap else None, "snapshot": str(snap.path) if snap else None,
            "image": image_key(submitted.get("image")),
            "torch": versions()["torch"], "packages": package_versions(sorted(named)),
            "run_dir": run_id(run_dir) if run_dir is not None else None}


def image_key(image: dict[str, Any] | None) -> str | None:
    """The image a checkpoint was written in, as compared at resume: its digest, else its name."""
    return None if not image else str(image.get("digest") or image.get("image"))


def run_id(run_dir: str | Path) -> str:
    """The run a checkpoint belongs to: its run directory, as every node of the run names it."""
    return str(Path(run_dir).resolve())


def resume_change(saved: dict[str, Any] | None, now: dict[str, Any]) -> dict[str, Any] | None:
    """What differs between the code a checkpoint was written under and this run's; None when
    nothing that can be compared does. The user's packages the checkpoint names are compared with
    this process's versions. A checkpoint from before provenance, or a run outside a
    snapshot (``cluster=local``), has no code hash: only torch's version is compared then."""
    if not saved:
        return None
    change: dict[str, Any] = {}
    if saved.get("code_hash") and now.get("code_hash") and saved["code_hash"] != now["code_hash"]:
        change["code_hash"] = [saved["code_hash"], now["code_hash"]]
        old = snapshot.read_manifest(Path(saved["snapshot"])) if saved.get("snapshot") else None
        new = snapshot.read_manifest(Path(now["snapshot"])) if now.get("snapshot") else None
        if old is not None and new is not None:
            change["files"] = snapshot.changed_files(old, new)
    if (saved.get("image") or now.get("image")) and saved.get("image") != now.get("image"):
        change["image"] = [saved.get("image"), now.get("image")]  # like torch: the image holds it
    if saved.get("torch") != now.get("torch"):
        change["torch"] = [saved.get("torch"), now.get("torch")]
    # The checkpoint's packages as this process has them (a package imported anew is a change of
    # code, found above); None: no longer installed.
    old_packages = saved.get("packages") or {}
    new_packages = package_versions(sorted(old_packages))
    packages = {name: [old_packages[name], new_packages[name]] for name in sorted(old_packages)
                if old_packages[name] != new_packages[name]}
    if packages:
        change["packages"] = packages
    return change or None


def describe_change(change: dict[str, Any]) -> str:
    parts = []
    if "code_hash" in change:
        old, new = change["code_hash"]
        files = change.get("files")
        if files is None:
            listed = " (the old snapshot is gone: its files cannot be listed)"
        else:
            listed = f"; files that differ: {', '.join(files[:10])}{' ...' if len(files) > 10 else ''}"
        parts.append(f"code snapshot {old[:12]} -> {new[:12]}{listed}")
    if "image" in change:
        old_image, new_image = (image or "(none)" for image in change["image"])
        parts.append(f"container image {old_image} -> {new_image}")
    if "torch" in change:
        parts.append(f"torch {change['torch'][0]} -> {change['torch'][1]}")
    for name, (old_version, new_version) in (change.get("packages") or {}).items():
        parts.append(f"package {name} {old_version} -> {new_version or '(not installed)'}")
    return "; ".join(parts)


def at_submission(cluster: ClusterConfig, targets: Sequence[str], run_dir: Path,
                  config_text: str, scripts: Sequence[Path] = ()) -> snapshot.Snapshot | None:
    """A single job's code snapshot (``cluster=slurm``, unless ``cluster.snapshot.enabled=false``)
    and its ``provenance.json``. Local and debug jobs start at once, from the working tree: no
    snapshot, the rest is recorded. ``scripts``: the Python files a command runs."""
    take = cluster.mode == "slurm" and cluster.snapshot.enabled
    snap = snapshot.take(cluster.snapshot, targets) if take else None
    found = origin(packages=user_packages(cluster.snapshot, targets, scripts))
    record(run_dir, snap, config_text, found, write_diff(run_dir, found),
           container.identity(cluster.container))
    return snap
