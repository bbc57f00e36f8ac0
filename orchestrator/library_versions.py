"""The versions of submitit and Hydra whose private parts Switchyard leans on, declared once.

Three places use what submitit and Hydra do not promise to keep, to save start-up time:

- submitit: ``fork_start.ForkingController`` subclasses the local ``Controller`` (its
  ``start_tasks`` and fields), ``ForkingSlurmExecutor`` and ``job_entry``'s executors override
  ``_submitit_command_str``, ``_internal_process_submissions`` and ``_make_submission_file_text``.
- Hydra: ``entry._mode_from_the_command_line`` replaces ``Hydra.get_mode`` (``hydra._internal``),
  ``entry._overrides`` reads the command line with Hydra's own ``get_args_parser``, and
  ``sweeps.points.CompositionCache`` wraps the ``HydraContext``'s config loader.

Each of them asks :func:`hooks_allowed` first. Where the installed version is outside the range
below, the hook is not used and the plain path is taken instead: submitit's own executors and
entry (each rank a new process), Hydra's own ``get_mode`` and loader, and the overrides left to
Hydra to refuse. The job is then slower to start, never wrong. ``tests/test_library_versions.py``
fails, naming the library and this module, when the installed version leaves its range: check each
hook above against the new version, then widen the range.

Not guarded, because nothing public renders an sbatch script: the dry run and ``slurm_request``
render it with submitit's ``_make_sbatch_string``, as submitit itself does at submission.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from importlib import metadata

from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Supported:
    """The releases ``[lowest, below)`` whose private parts the hooks were written against."""

    lowest: str
    below: str

    def admits(self, version: str) -> bool:
        try:
            return Version(self.lowest) <= Version(version) < Version(self.below)
        except InvalidVersion:
            return False

    def __str__(self) -> str:
        return f">={self.lowest},<{self.below}"


# Distribution name -> releases. Widen only after reading each hook in the docstring against the
# new release's source.
SUPPORTED = {
    "submitit": Supported("1.5", "1.6"),
    "hydra-core": Supported("1.3", "1.4"),
}


def installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def outside(distribution: str) -> str | None:
    """None when the installed ``distribution`` is one the hooks were written for; else why not, in
    words a user can act on."""
    supported = SUPPORTED[distribution]
    version = installed(distribution)
    if version is not None and supported.admits(version):
        return None
    return (f"{distribution} {version or '(not installed)'} is outside the versions Switchyard's "
            f"start-up shortcuts were written for ({supported}); it takes the plain path instead")


@functools.cache
def hooks_allowed(distribution: str) -> bool:
    """Whether the private hooks into ``distribution`` may be used; says once on stderr when not."""
    reason = outside(distribution)
    if reason is not None:
        print(f"switchyard: {reason}", file=sys.stderr, flush=True)
    return reason is None
