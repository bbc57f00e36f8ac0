"""Switchyard for your own code.

- ``switchyard.preemption``: for a script run by ``switchyard run``: was a stop asked for, where to
  checkpoint, and the exit code that asks for a requeue. Imports neither torch nor the trainer.
- ``switchyard.submit(fn, ...)``: a Python function as every rank of a job (as submitit's
  ``executor.submit``, with Switchyard's config groups, run directory, registry and requeue).

Importing this package is light: ``submit`` loads the orchestrator on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard.api import Job, submit

__all__ = ["Job", "submit"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from switchyard import api

        return getattr(api, name)
    raise AttributeError(f"module 'switchyard' has no attribute {name!r}")
