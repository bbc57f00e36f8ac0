"""``container=pyxis|apptainer``: the ranks of a SLURM job run inside an image.

One place turns a ``ContainerConfig`` into the job's command line, so the dry run shows what is
submitted:

- pyxis: ``srun --container-image=IMAGE --container-mounts=... --container-workdir=...
  --container-env=... --no-container-mount-home --container-name=...`` (srun arguments), and
  the image's ``python`` runs the rank;
- apptainer: the rank's Python is ``apptainer exec --nv --bind ... IMAGE python``.

The mounts follow from the config (``mounts_for``): the code snapshot, the run directory, the
submitting directory and every path the job names (and where a symlink on the way to one leads)
are bound at the same path inside, so no path differs between the submitting machine and the
ranks; what the runtime would split, or a user mount that would hide or take over one of them, is
refused before submission. Switchyard itself imports inside the image
from its snapshot, which is put first on ``PYTHONPATH`` (``snapshot.setup_lines``): the image needs
Python, torch and Switchyard's dependencies, not Switchyard.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.config import ConfigError, ContainerConfig, invalid
from orchestrator.launch import snapshot

# Variables the batch script sets for the ranks (``snapshot.setup_lines``): pyxis gives the image's
# own value precedence unless named in --container-env; apptainer unless set as APPTAINERENV_*.
PASSED_ENV = ("PYTHONPATH", "PYTHONSAFEPATH", "SWITCHYARD_SNAPSHOT", "SWITCHYARD_IMAGE",
              "SWITCHYARD_SUBMITTED_VERSION")
# Set by the job's script for its ranks: the image they run in, and the submitter's Switchyard.
IMAGE_ENV, VERSION_ENV = "SWITCHYARD_IMAGE", "SWITCHYARD_SUBMITTED_VERSION"
# The Python that runs inside the image: the image's own, found on its PATH.
IMAGE_PYTHON = "python"


@dataclass(frozen=True)
class Mount:
    source: Path  # on the node
    target: str  # inside the container
    read_only: bool = False
    why: str = ""  # the config key it comes from, for errors

    def spec(self) -> str:
        return f"{self.source}:{self.target}{':ro' if self.read_only else ''}"


@dataclass(frozen=True)
class Need:
    """A path the ranks read or write, mounted at its own path inside the image."""

    why: str  # the config key it comes from (data.path, hydra.run.dir) or, without one, what it is
    path: str | Path | None
    made: bool = False  # a directory the submission makes before the job starts (``make``)
    shared: bool = False  # a working directory: a user mount may go inside it (not over it)
    named: str | None = None  # the key's value, where ``path`` differs (a symlink's destination)
    fix: str = ""  # the fix to propose where ``why`` is no key

    def where(self) -> Path:
        """Absolute, ``~`` and ``..`` resolved as the shell would, symlinks left as they are."""
        return _absolute(str(self.path))


# Separators of the mount lists (apptainer --bind, pyxis --container-mounts: SRC:DST[:ro],...):
# a path that holds one is read as two paths, or as a path and options, on the node.
SEPARATORS = (",", ":")


def _absolute(path: str) -> Path:
    return Path(os.path.abspath(Path(path).expanduser()))


def _normal_target(target: str) -> str:
    """A mount target as the runtime reaches it: ``..`` and ``.`` resolved (POSIX keeps a
    leading ``//``; a mount point has none)."""
    return "/" + os.path.normpath(target).lstrip("/")


def mounts_for(container: ContainerConfig, needs: Sequence[Need], dry_run: bool = False) -> list[Mount]:
    """Every mount of the job: one per path it needs (each at its own path, and each symlink's
    destination that the mounts would not reach), then the user's (``cluster.container.mounts``).
    Refused (``ConfigError``) before anything is made or submitted: a mount that the runtime would
    split (``SEPARATORS``), a user mount whose source is missing or whose target hides a path the
    job needs or lies inside one. Then the directories the job writes into are made (``make``),
    unless ``dry_run``: a dry run makes nothing and shows the mounts the submission would have."""
    wanted = followed(needs)
    derived = needed(wanted)
    extra = user_mounts(container)
    for m in extra:
        check_user_mount(container, m, wanted)
    make(wanted, dry_run)
    return [*derived, *(m for m in extra if m not in derived)]


def needed(needs: Iterable[Need]) -> list[Mount]:
    """The mounts the paths need, each at its own path inside. A path not there yet is mounted
    through its nearest existing parent, unless that is ``/`` or a directory right under it
    (``/opt``, ``/usr``: the host's would hide the image's own, its Python among them): the path
    stays missing, as the job's own checks report. A directory the submission makes (``made``) is
    mounted at its own path, made or not. A path inside another one's mount is left to that
    mount. A mount whose path holds a separator is refused, naming the key it comes from."""
    found: list[tuple[Mount, Need]] = []
    for need in needs:
        if need.path is None or str(need.path) == "":
            continue
        where = need.where()
        missing = not where.exists() and not need.made
        while missing and not where.exists() and where != where.parent:
            where = where.parent
        if where == where.parent or (missing and where.parent == where.parent.parent):
            continue
        found.append((Mount(where, str(where), why=need.why), need))
    kept: list[Mount] = []
    for m, need in sorted(found, key=lambda pair: len(pair[0].source.parts)):
        if not any(m.source == k.source or k.source in m.source.parents for k in kept):
            check_separators(m.source, need)
            kept.append(m)
    return kept


def check_separators(mounted: Path, need: Need) -> None:
    """Refuse a mount that the runtime would split, naming the key its path comes from."""
    held = " and ".join(repr(c) for c in SEPARATORS if c in str(mounted))
    if not held:
        return
    value = need.named or str(need.path)
    named = _absolute(value)
    what = "it" if mounted == named else f"its mount {mounted}"
    if not (need.where() == named or named in need.where().parents):
        what += f" (where it leads through a symlink: {need.where()})"
    why = (f"{what} holds {held}, which the container's mount list (apptainer --bind, pyxis "
           f"--container-mounts: SRC:DST,...) reads as separators, so the job would fail on the node")
    if " " in need.why:  # no config key: what it is
        raise ConfigError(f"{need.why} {value!r} cannot be mounted into the image: {why} (try {need.fix})")
    raise invalid(need.why, value, why, f"{need.why}=<a path without ',' or ':'>, or rename the "
                                         "directory that holds them")


def followed(needs: Sequence[Need], limit: int = 40) -> list[Need]:
    """The paths, and where each symlink on the way to one leads, until every one is reached
    inside: a path inside a mount that goes through a symlink (``data -> /scratch/ds`` under the
    submitting directory) is a link to a path the image lacks unless that is mounted too. A
    path that is itself a mount is not followed: the runtime mounts what its source leads to."""
    wanted = list(needs)
    for _ in range(limit):  # a chain of links, or a loop of them, ends here
        mounts = needed(wanted)
        known = {n.where() for n in wanted if n.path}
        leads = (_through_symlink(w, mounts) for w in wanted if w.path)
        new = [n for n in leads if n is not None and n.where() not in known]
        if not new:
            break
        wanted += list({n.where(): n for n in new}.values())
    return wanted


def _through_symlink(need: Need, mounts: Sequence[Mount]) -> Need | None:
    """Where the first symlink below the mount that holds ``need`` leads (with the rest of the
    path), as a path the ranks need too; None when no symlink lies on the way."""
    path = need.where()
    cover = next((m for m in mounts if m.source == path or m.source in path.parents), None)
    if cover is None or cover.source == path:
        return None
    here = cover.source
    for part in path.relative_to(cover.source).parts:
        step = here / part
        if step.is_symlink():
            lead = Path(os.path.normpath(here / os.readlink(step)))  # an absolute link replaces here
            return Need(need.why, lead / path.relative_to(step), need.made, need.shared,
                        need.named or str(need.path), need.fix)
        if not step.exists():
            return None
        here = step
    return None


def make(needs: Iterable[Need], dry_run: bool) -> None:
    """Make each directory the submission makes (``Need.made``), for the runtime to mount it at
    its own path; a dry run makes nothing."""
    for need in needs:
        if dry_run or not need.made or not need.path:
            continue
        try:
            need.where().mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise invalid(need.why, str(need.path), f"it cannot be made ({e.strerror or e}) to be mounted",
                          f"{need.why}=<a directory you can write>") from e


def user_mounts(container: ContainerConfig) -> list[Mount]:
    """``cluster.container.mounts``: ``SRC``, ``SRC:DST`` or ``SRC:DST:ro``, the target's ``..``
    resolved."""
    found = []
    for i, spec in enumerate(container.mounts):
        parts = spec.split(":")
        key = f"cluster.container.mounts[{i}]"
        if not 1 <= len(parts) <= 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")) or not parts[0]:
            raise invalid(key, spec, "a mount is SRC, SRC:DST or SRC:DST:ro", f"{key}=/data:/data:ro")
        if "," in spec:
            raise invalid(key, spec, "',' separates mounts in the container's mount list (apptainer "
                          "--bind, pyxis --container-mounts), so it would be read as two",
                          "one mount per entry, from paths without ','")
        source = _absolute(parts[0])
        target = parts[1] if len(parts) > 1 and parts[1] else str(source)
        if not target.startswith("/"):
            raise invalid(key, spec, f"the target {target!r} is not an absolute path",
                          f"{key}={parts[0]}:/{target.lstrip('./')}")
        found.append(Mount(source, _normal_target(target), len(parts) == 3 and parts[2] == "ro", key))
    return found


def check_user_mount(container: ContainerConfig, m: Mount, needs: Sequence[Need]) -> None:
    """Refuse a user mount whose source is missing, or whose target hides a path the job needs
    (the path itself or a directory above it) or lies inside one that the job needs whole: under
    the run directory, the submitting side would never see the logs, results and checkpoints
    written over the mount (the job hung, then failed)."""
    spec = container.mounts[int(m.why.split("[")[1][:-1])]
    if not m.source.exists():
        raise invalid(m.why, spec, f"its source {m.source} does not exist on this machine (the nodes "
                      "would fail to mount it)", f"{m.why}=<an existing path>")
    target = Path(m.target)
    if m.source == target:  # the same directory at its own path: it hides nothing
        return
    for need in needs:
        if not need.path:
            continue
        path = need.where()
        if target == path or target in path.parents:
            raise invalid(m.why, spec, f"its target {m.target} would hide {path}, which the job needs "
                          f"({need.why}) under {m.source}'s files", f"{m.why}={m.source}:<a target "
                          f"outside {path}>")
        if path in target.parents and not need.shared:
            raise invalid(m.why, spec, f"its target {m.target} lies inside {path} ({need.why}), which "
                          "the job needs whole: what the job writes there would go into "
                          f"{m.source} instead, unseen by the submitting side and the checks",
                          f"{m.why}={m.source}:<a target outside {path}>")


def container_name(run_dir: Path, container: ContainerConfig) -> str:
    """pyxis's name for the imported image: the same for every attempt of one run in one image, so
    a requeue finds it on the node instead of importing it again. pyxis reuses a named container
    without looking at the image, so another image (or a local image file rebuilt since: its size
    and time of last change) gets another name, and a resubmission never runs the old one."""
    image = image_ref(container)
    key = [str(run_dir.absolute()), image]
    if is_local_file(image) and Path(image).is_file():
        stat = Path(image).stat()
        key += [str(stat.st_size), str(stat.st_mtime_ns)]
    return "switchyard-" + hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]


def image_ref(container: ContainerConfig) -> str:
    """The image as the nodes are told it: a local file by its absolute path (a ``~`` or a relative
    path would be read on the node, from another home or directory), a URI as it is."""
    image = str(container.image)
    return str(Path(image).expanduser().absolute()) if is_local_file(image) else image


def srun_args(container: ContainerConfig, mounts: Sequence[Mount], run_dir: Path) -> list[str]:
    """pyxis's srun arguments (none for another runtime)."""
    if container.runtime != "pyxis":
        return []
    args = [f"--container-image={image_ref(container)}",
            f"--container-mounts={','.join(m.spec() for m in mounts)}",
            f"--container-workdir={container.workdir or os.getcwd()}",
            f"--container-env={','.join(dict.fromkeys([*PASSED_ENV, *container.env]))}",
            f"--container-name={container_name(run_dir, container)}"]
    args.append("--container-mount-home" if container.mount_home else "--no-container-mount-home")
    args.append("--container-writable" if container.writable else "--container-readonly")
    return args


def python(container: ContainerConfig, mounts: Sequence[Mount], gpus_per_node: int) -> str | None:
    """The command that runs a rank's Python: None (the submitting machine's) without a container."""
    if container.runtime == "none":
        return None
    if container.runtime == "pyxis":
        return IMAGE_PYTHON
    argv = ["apptainer", "exec"]
    if gpus_per_node > 0 and (container.nv or container.rocm):
        argv.append("--rocm" if container.rocm else "--nv")
    if not container.mount_home:
        argv.append("--no-home")
    if container.writable:
        argv.append("--writable-tmpfs")
    argv += ["--bind", ",".join(m.spec() for m in mounts), "--pwd", container.workdir or os.getcwd(),
             image_ref(container), IMAGE_PYTHON]
    return " ".join(shlex.quote(a) for a in argv)


def setup_lines(container: ContainerConfig) -> list[str]:
    """The job script's lines for the ranks: their image and the submitter's Switchyard
    (``rank_check``); under apptainer also the variables that must win over the image's own.

    apptainer passes the host's environment in, but an image's ``%environment`` (``PYTHONPATH``,
    often) overrides it; ``APPTAINERENV_NAME`` is apptainer's way to set ``NAME`` inside over the
    image. Exported as variables, not ``--env NAME=VALUE`` on the command line: ``--env`` splits
    its argument at commas, and a value with a space would split the command. A variable unset
    when the job starts is not passed (an empty ``PYTHONPATH`` would still hide the image's).
    """
    version = own_version() or "unknown"
    lines = [f"export {IMAGE_ENV}={shlex.quote(image_ref(container))} {VERSION_ENV}={version}"]
    if container.runtime == "apptainer":
        for name in dict.fromkeys([*PASSED_ENV, *container.env]):
            lines.append(f'if [ -n "${{{name}+set}}" ]; then export APPTAINERENV_{name}="${{{name}}}"; fi')
    return lines


def own_version() -> str | None:
    """The installed Switchyard's version (its distribution's metadata); None when not installed."""
    try:
        return importlib.metadata.version("switchyard")
    except importlib.metadata.PackageNotFoundError:
        return None


def rank_check(environ: Mapping[str, str], from_snapshot: bool) -> str | None:
    """On a rank: why it cannot run in its image, in one line; None when it can. Without the
    snapshot (``cluster.snapshot.enabled=false``), the image's installed Switchyard runs, and must
    be the submitter's version."""
    image, submitted = environ.get(IMAGE_ENV), environ.get(VERSION_ENV)
    if image is None or submitted in (None, "unknown") or from_snapshot:
        return None
    found = own_version()
    if found is None or found == submitted:
        return None  # not installed: imported from a mounted checkout, the submitter's own code
    return (f"the image {image} has Switchyard {found} installed, the submitter has {submitted}: "
            f"install Switchyard {submitted} in the image, or leave cluster.snapshot.enabled=true "
            f"(the ranks then import the submitter's code from its snapshot)")


def inside_image(environ: Mapping[str, str]) -> str:
    """' in the image IMAGE' on a rank that runs in one, for its errors; else ''."""
    image = environ.get(IMAGE_ENV)
    return f" in the image {image}" if image else ""


def is_local_file(image: str) -> bool:
    return "://" not in image and "#" not in image and (
        image.startswith(("/", "./", "~")) or image.endswith((".sif", ".sqsh", ".squashfs", ".img")))


def check(container: ContainerConfig, dry_run: bool = False, srun_help: str | None = None) -> list[str]:
    """Refuse (``ConfigError``) what would fail on every node; returns warnings to print. A dry run
    only warns where the submitting machine lacks the runtime (its script is what is looked at)."""
    if container.runtime == "none":
        return []
    check_image_file(container)
    warnings = []
    if container.runtime == "pyxis":
        try:
            text = srun_help if srun_help is not None else _srun_help()
        except ConfigError as e:  # no srun here: a dry run's script can still be looked at
            if not dry_run:
                raise
            return [f"{e}; the script below is shown unchecked"]
        if "--container-image" not in text:
            why = ("this cluster's srun has no --container-image option: pyxis (the SLURM plugin "
                   "behind container=pyxis) is not installed")
            if not dry_run:
                raise invalid("container", "pyxis", why, "container=apptainer, or a cluster with pyxis")
            warnings.append(f"container=pyxis: {why}; the script below would fail on it")
    if container.runtime == "apptainer" and not (shutil.which("apptainer") or shutil.which("singularity")):
        warnings.append("container=apptainer: neither apptainer nor singularity is on this machine's "
                        "PATH; the job needs it on the nodes' PATH")
    return warnings


IMAGE_SUFFIXES = (".sif", ".sqsh", ".squashfs", ".img")
# what a registry image looks like to each runtime, proposed when no image file lies near the path
REGISTRY_EXAMPLES = {"apptainer": "docker://pytorch/pytorch", "pyxis": "nvcr.io#nvidia/pytorch:24.05-py3"}


def check_image_file(container: ContainerConfig) -> None:
    """A local image file that is not there: refused, naming it and the image files beside it."""
    image = str(container.image)
    if is_local_file(image) and not Path(image).expanduser().is_file():
        raise invalid("cluster.container.image", image, "no such file on this machine",
                      _image_fix(Path(image).expanduser().absolute(), container.runtime))


def _image_fix(missing: Path, runtime: str) -> str:
    """The image file in the same folder whose name is closest to the missing one's; where there
    is none, a registry image in the runtime's syntax (never the refused path again)."""
    folder = missing.parent
    nearby = sorted(p.name for p in folder.iterdir()
                    if p.suffix in IMAGE_SUFFIXES and p.is_file()) if folder.is_dir() else []
    if nearby:
        closest = difflib.get_close_matches(missing.name, nearby, n=1, cutoff=0)[0]
        rest = [n for n in nearby if n != closest]
        others = f"; {folder} also holds {', '.join(rest)}" if rest else ""
        return f"cluster.container.image={folder / closest}{others}"
    where = f"{folder} holds no image file" if folder.is_dir() else f"{folder} does not exist"
    return (f"the path of an image file you built ({where}), or a registry image: "
            f"cluster.container.image={REGISTRY_EXAMPLES.get(runtime, REGISTRY_EXAMPLES['apptainer'])}")


def _srun_help() -> str:
    try:
        return subprocess.run(["srun", "--help"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"container=pyxis needs srun to check for pyxis, which cannot run here "
                          f"({e}): submit from a SLURM login node") from e


def identity(container: ContainerConfig) -> dict[str, str | None] | None:
    """What provenance records of the image: its runtime, name and its file's sha256 (a local file)
    or the digest in its URI; None without a container."""
    if container.runtime == "none":
        return None
    image = str(container.image)
    digest = None
    if is_local_file(image):
        check_image_file(container)  # it is recorded before the other checks run
        path = Path(image_ref(container))
        stat = path.stat()
        digest = file_digest(path, stat.st_size, stat.st_mtime_ns)
    elif "@sha256:" in image:
        digest = image[image.index("@") + 1:]
    return {"runtime": container.runtime, "image": image, "digest": digest}


@functools.lru_cache(maxsize=16)
def file_digest(path: Path, size: int, mtime_ns: int) -> str:
    """An image file's sha256, read once per submission for all the points of a sweep (the size
    and time of last change are part of the key: a rebuilt image is read again)."""
    return f"sha256:{snapshot.file_hash(path)}"


def describe(found: dict[str, str | None] | None) -> str:
    """One line: the image a run used."""
    if not found:
        return "none (the nodes' own Python)"
    digest = found.get("digest") or "no digest (a tag can move: pin IMAGE@sha256:...)"
    return f"{found.get('image')} ({found.get('runtime')}, {digest})"


def warn(lines: Iterable[str]) -> None:
    for line in lines:
        print(f"warning: {line}", file=sys.stderr)
