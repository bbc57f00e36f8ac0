"""The code a SLURM job runs, copied when it is queued: a content-addressed snapshot store.

A job can wait in the queue for hours and a sweep's points start days apart; a job that imported
the working tree when it started ran whatever was there then (an edit half saved, another branch).
At submission the importable code is copied into ``STORE/<sha256>/`` and every rank imports from
there first (``setup_lines``). What is copied (``sources``): Switchyard's own packages, the top-level
package or module each user target (``model._target_``, ``task._target_``) comes from when it lives
outside site-packages, and ``cluster.snapshot.include``.

The name is the hash of the manifest (every file's relative path and content hash), so unchanged
code is stored once however many jobs use it, and a snapshot's content can never change under its
name. It is written into a temporary directory beside the store's entries and renamed into place:
a directory named by a hash is always complete.
"""

from __future__ import annotations

import compileall
import contextlib
import fnmatch
import hashlib
import importlib.util
import json
import os
import py_compile
import re
import shlex
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from orchestrator.config import ConfigError, SnapshotConfig

# Switchyard's own top-level packages, found beside ``orchestrator`` (a checkout or an install).
OWN_PACKAGES = ("orchestrator", "sharding", "durable", "jobs", "conf", "switchyard", "hydra_plugins")
MANIFEST = ".switchyard-snapshot.json"  # inside each snapshot: what it holds, for diffs at resume
SNAPSHOT_ENV = "SWITCHYARD_SNAPSHOT"  # set on the nodes: the snapshot the ranks import from
DEFAULT_STORE = Path("~/.cache/switchyard/snapshots")
_TMP_PREFIX = ".tmp-"
# A temporary directory as _publish and prune name them (mkdtemp's prefix, then its own suffix):
# prune removes no other ".tmp-" entry a user may keep in a store.
_OWN_TMP = re.compile(r"^\.tmp-(pruned-)?[0-9a-f]{12}-")


class SnapshotError(ConfigError):
    """The snapshot cannot be taken (too large, a source missing); nothing was queued."""


@dataclass(frozen=True)
class Source:
    """A file or directory copied to ``<snapshot>/<name>``."""

    path: Path
    name: str


@dataclass(frozen=True)
class Snapshot:
    hash: str  # sha256 of the manifest: the snapshot's name in the store
    path: Path  # STORE/<hash>, put first on the ranks' PYTHONPATH
    files: dict[str, str]  # relative path -> sha256 of its content
    created: bool  # False: an identical snapshot was already stored (nothing written)


def store_dir(config: SnapshotConfig) -> Path:
    return Path(config.dir or DEFAULT_STORE).expanduser().absolute()


# ------------------------------------------------------------------------------------------------
# What is copied


def own_root() -> Path:
    """The directory ``orchestrator`` was imported from (a checkout, a snapshot or site-packages)."""
    return Path(__file__).resolve().parents[2]


def own_sources() -> list[Source]:
    """Switchyard's packages, beside ``orchestrator``."""
    root = own_root()
    return [Source(root / name, name) for name in OWN_PACKAGES if (root / name).is_dir()]


def module_source(target: str) -> Source | None:
    """Where the top-level package or module of ``target`` (``my_pkg.models.Net``) lives; None for
    one installed in site-packages or the standard library (versions record those), or unknown."""
    top = target.split(".", 1)[0]
    if not top or top in OWN_PACKAGES:
        return None
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    path = Path(locations[0]) if locations else Path(spec.origin or "")
    if not path.exists() or installed(path):
        return None
    return Source(path.resolve(), path.name)


def installed(path: Path | str) -> bool:
    """The standard library's or an installed package's file, not the user's code: the one rule,
    for the snapshot and for what the memory estimate remembers (``estimate_memo``)."""
    resolved = os.path.realpath(path)
    return ("site-packages" in resolved or "dist-packages" in resolved
            or resolved.startswith(_installed_roots()))


@lru_cache(maxsize=1)
def _installed_roots() -> tuple[str, ...]:
    roots = {sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib", "platstdlib")}
    return tuple(os.path.realpath(root) + os.sep for root in roots)


TARGET_KEYS = ("model", "task")  # config groups whose ``_target_`` names the user's code


def targets(config: Any) -> list[str]:
    """The user targets a config names (``model._target_``, ``task._target_``), read alike from
    typed dataclasses, dicts and DictConfigs."""
    found = []
    for key in TARGET_KEYS:
        node = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        target = node.get("_target_") if isinstance(node, Mapping) else getattr(node, "_target_", None)
        if isinstance(target, str):
            found.append(target)
    return found


def include_sources(include: Sequence[str]) -> list[Source]:
    sources = []
    for i, item in enumerate(include):
        path = Path(item).expanduser().absolute()
        if not path.exists():
            raise SnapshotError(f"cluster.snapshot.include[{i}]={item!r} is invalid: no such file or "
                                f"directory (try an existing path, or cluster.snapshot.include=[])")
        sources.append(Source(path, path.name))
    return sources


def sources(config: SnapshotConfig, targets: Sequence[str] = ()) -> list[Source]:
    """Everything one job's snapshot holds: own packages, user targets' modules, includes."""
    found = [*own_sources(), *(s for s in map(module_source, targets) if s is not None),
             *include_sources(config.include)]
    by_name: dict[str, Source] = {}
    for source in found:
        other = by_name.setdefault(source.name, source)
        if other.path != source.path:
            raise SnapshotError(f"the snapshot would hold two different {source.name!r}: {other.path} "
                                f"and {source.path} (rename one, or drop it from cluster.snapshot.include)")
    return list(by_name.values())


# ------------------------------------------------------------------------------------------------
# Manifest and store


def walk(source: Source, exclude: Sequence[str]) -> Iterator[tuple[str, Path]]:
    """(relative path in the snapshot, file) for every file kept; excluded names are pruned."""
    if source.path.is_file():
        yield source.name, source.path
        return
    for folder, dirs, names in os.walk(source.path, onerror=_unlistable):
        base = Path(folder)
        # A package named like an exclude (my_pkg/data/__init__.py) is code the job imports: kept.
        dirs[:] = sorted(d for d in dirs if not _excluded(d, exclude) or (base / d / "__init__.py").is_file())
        for name in sorted(names):
            file = base / name
            if not _excluded(name, exclude) and file.is_file():
                yield f"{source.name}/{file.relative_to(source.path).as_posix()}", file


def _unlistable(e: OSError) -> None:
    """os.walk skips a directory it cannot list, silently: the snapshot would lack its modules."""
    raise unreadable(Path(e.filename or "?"), e) from e


def unreadable(path: Path, e: OSError) -> SnapshotError:
    """A file or directory of the snapshot's sources that cannot be read, named with the fix."""
    return SnapshotError(
        f"cannot read {path} for the code snapshot: {e.strerror or type(e).__name__}. Make it readable, "
        f"or leave it out (add {path.name!r} to cluster.snapshot.exclude=[...]), or turn snapshots off "
        f"(cluster.snapshot.enabled=false)")


def _excluded(name: str, exclude: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in exclude)


def collect(sources_: Sequence[Source], config: SnapshotConfig) -> dict[str, Path]:
    """Relative path -> file, refused when the total exceeds ``max_mb`` (naming the largest)."""
    files = dict(item for s in sources_ for item in walk(s, config.exclude))
    sizes = {rel: _size(path) for rel, path in files.items()}
    total = sum(sizes.values())
    if total > config.max_mb * 2**20:
        largest = sorted(sizes, key=lambda rel: -sizes[rel])[:5]
        named = ", ".join(f"{rel} ({sizes[rel] / 2**20:.1f} MiB)" for rel in largest)
        raise SnapshotError(
            f"the code snapshot would be {total / 2**20:.1f} MiB, over cluster.snapshot.max_mb="
            f"{config.max_mb:g}; its largest files: {named}. Exclude them (cluster.snapshot.exclude="
            f"[...]), raise cluster.snapshot.max_mb, or turn snapshots off (cluster.snapshot.enabled=false)")
    return files


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise unreadable(path, e) from e


def file_hash(path: Path) -> str:
    """sha256 of a file's content; one that cannot be read is a SnapshotError naming it."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as e:
        raise unreadable(path, e) from e
    return digest.hexdigest()


def manifest_hash(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def take(config: SnapshotConfig, targets: Sequence[str] = ()) -> Snapshot:
    """Snapshot the code a job with these user targets imports; reuse an identical stored one."""
    files = collect(sources(config, targets), config)
    hashes = {rel: file_hash(path) for rel, path in sorted(files.items())}
    digest = manifest_hash(hashes)
    store = store_dir(config)
    final = store / digest
    if final.is_dir():
        with contextlib.suppress(OSError):  # a read-only shared store: prune keeps it by its jobs
            os.utime(final)  # reused now: `switchyard snapshots prune` counts its age from here
        return Snapshot(digest, final, hashes, created=False)
    store.mkdir(parents=True, exist_ok=True)
    created = _publish(store, final, files, hashes)
    return Snapshot(digest, final, hashes, created=created)


def _publish(store: Path, final: Path, files: dict[str, Path], hashes: dict[str, str]) -> bool:
    """Copy into a temporary directory in the store, then rename it to its hash: a killed copy
    leaves only a ``.tmp-`` directory, never a half snapshot under a hash. Another submission
    that published the same snapshot first wins; ours is removed (its content is the same)."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{final.name[:12]}-", dir=store))
    try:
        for rel, path in files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
        (tmp / MANIFEST).write_text(json.dumps({"hash": final.name, "files": hashes}, indent=0))
        compile_bytecode(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # ENOTEMPTY/EEXIST: published meanwhile by another submission
            if not final.is_dir():
                raise
            return False
        return True
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def compile_bytecode(root: Path) -> None:
    """Each module's bytecode, compiled once into the snapshot before it is published. A snapshot
    never changes, so its ``.pyc`` files record their source's hash and are never checked against
    it (``UNCHECKED_HASH``). Without them every rank compiled every module at every start (under
    ``PYTHONDONTWRITEBYTECODE``, or a store it cannot write), or raced the other ranks to write
    ``__pycache__`` into a published snapshot. Importing Switchyard's modules took 0.17 s of CPU
    per rank from source and 0.10 s from these (medians of 7, measured here), paid again at each
    requeue and by every point of a sweep. A file that does not compile is left to fail where
    it is imported, as it would from the working tree."""
    compileall.compile_dir(root, quiet=2, workers=1,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)


def prune(store: Path, keep: Collection[str], older_than_s: float, dry_run: bool = False,
          now: float | None = None) -> list[Path]:
    """Remove the store's snapshots that are not in ``keep`` (hashes) and were neither taken nor
    reused for ``older_than_s``, and the temporary copies of submissions that died that long ago;
    returns what was (``dry_run``: would be) removed. Anything else in the store is left alone.
    A snapshot is renamed away from its hash before it is deleted, so no job ever finds a
    half-deleted one under its name."""
    cutoff = (time.time() if now is None else now) - older_than_s
    removed = []
    for entry in sorted(store.iterdir()) if store.is_dir() else []:
        is_snapshot = len(entry.name) == 64 and all(c in "0123456789abcdef" for c in entry.name)
        ours = is_snapshot or _OWN_TMP.match(entry.name) is not None
        if entry.is_symlink() or not entry.is_dir() or not ours:
            continue
        if (is_snapshot and entry.name in keep) or entry.stat().st_mtime > cutoff:
            continue
        removed.append(entry)
        if not dry_run:
            doomed = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}pruned-{entry.name[:12]}-", dir=store))
            os.replace(entry, doomed)  # onto the empty directory: atomic, the hash name is gone
            shutil.rmtree(doomed, ignore_errors=True)
    return removed


def read_manifest(path: Path) -> dict[str, str] | None:
    """A stored snapshot's files (relative path -> hash); None when it is gone or unreadable."""
    try:
        return dict(json.loads((path / MANIFEST).read_text())["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def changed_files(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Files added, removed or edited between two manifests, sorted."""
    return sorted(rel for rel in old.keys() | new.keys() if old.get(rel) != new.get(rel))


# ------------------------------------------------------------------------------------------------
# On the nodes


def setup_lines(snap: Snapshot) -> list[str]:
    """sbatch script lines (before srun; srun passes the environment on) that make every rank
    import from the snapshot. ``python -m`` puts its working directory first on ``sys.path``, where
    the checkout would shadow the snapshot: PYTHONSAFEPATH (Python 3.11) leaves it out, and the
    job's directory goes last instead, so modules not in the snapshot still import as before.

    First the job checks that every file of the snapshot is still there (``check_script``), and
    stops with one line naming it otherwise: a snapshot deleted while the job waited (``switchyard
    snapshots prune``, by hand) would leave the job's directory on ``PYTHONPATH``, and it would run
    the working tree under the snapshot's name."""
    path = str(snap.path)
    return [f"{check_script(path)} || exit 1",
            f"export PYTHONPATH={_sh(path)}${{PYTHONPATH:+:$PYTHONPATH}}:\"$PWD\"",
            "export PYTHONSAFEPATH=1", f"export {SNAPSHOT_ENV}={_sh(path)}"]


_GONE = ("the code snapshot {path} of this job {what}: it was deleted after the job was submitted, "
         "so the job stops before running your code. Resubmit the job (a new snapshot is taken), or "
         "submit with cluster.snapshot.enabled=false to run the working tree")


def gone_line(path: Path) -> str:
    """Why a job whose snapshot is missing stops (``check_script`` also names an incomplete one)."""
    return _GONE.format(path=path, what="is missing")


# The check, run by the batch script's own shell on the batch node with the standard tools (grep,
# sed), before anything of Switchyard or the user runs. Not the submitting machine's Python: with
# a container it is not on the nodes (the image's is, inside), and every job failed there. It
# reads the manifest as ``_publish`` writes it (json.dumps, indent=0: one '"path": "sha256",' per
# line inside "files"); a name that JSON escapes (a quote, a backslash, non-ASCII) is not looked
# at, and a rank still stops where the manifest itself is gone (``submit.RankEntry``).
_CHECK = r"""(
root=@ROOT@
manifest="$root"/@MANIFEST@
what=
if ! grep -qx '"files": {' "$manifest" 2>/dev/null; then
  what="is missing"
else
  what=$(sed -n '/^"files": {$/,/^}/s/^"\([^"\\]*\)": "[0-9a-f]*",\{0,1\}$/\1/p' "$manifest" | {
    n=0 first=
    while IFS= read -r rel; do
      [ -f "$root/$rel" ] || { n=$((n + 1)); [ -n "$first" ] || first=$rel; }
    done
    if [ "$n" -gt 1 ]; then echo "is incomplete ($first and $((n - 1)) more gone)"
    elif [ "$n" -eq 1 ]; then echo "is incomplete ($first gone)"; fi; })
fi
[ -z "$what" ] || { printf @MESSAGE@ "$root" "$what" >&2; exit 1; }
)"""


def check_script(path: str) -> str:
    """The shell lines that exit 1 with ``error: ...`` (``_GONE``) when the snapshot at ``path``
    is missing or incomplete."""
    message = "error: " + _GONE.replace("{path}", "%s").replace("{what}", "%s") + "\\n"
    return (_CHECK.replace("@ROOT@", _sh(path)).replace("@MANIFEST@", _sh(MANIFEST))
            .replace("@MESSAGE@", _sh(message)))


def _sh(value: str) -> str:
    return shlex.quote(value)


@lru_cache(maxsize=1)
def current() -> Snapshot | None:
    """The snapshot this process imports from (``SWITCHYARD_SNAPSHOT``); None outside one."""
    value = os.environ.get(SNAPSHOT_ENV)
    if not value:
        return None
    path = Path(value)
    files = read_manifest(path)
    return Snapshot(path.name, path, files or {}, created=False)


def running() -> Snapshot | None:
    """The snapshot whose code this process really runs: the one ``SWITCHYARD_SNAPSHOT`` names,
    its manifest readable, and Switchyard's own modules imported from it. None otherwise: what ran
    was not that snapshot, and provenance must not name it (a later resume would pass as the same
    code)."""
    snap = current()
    if snap is None or not snap.files or not imported_from(__file__):
        return None
    return snap


def imported_from(module_file: str | None) -> bool:
    """Whether a module file lies in the current snapshot (``orchestrator.__file__`` on a rank)."""
    snap = current()
    return bool(snap and module_file and Path(module_file).resolve().is_relative_to(snap.path.resolve()))

