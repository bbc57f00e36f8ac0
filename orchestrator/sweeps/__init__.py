"""Hydra sweeps as SLURM job arrays (or local processes), and what was submitted.

- ``launcher``: the logic behind Switchyard's Hydra launcher (compose, check, group, submit, wait);
- ``registry``: the SQLite record of sweeps, jobs and attempts;
- ``status``: ``switchyard status/show/logs/cancel/resubmit``.

The top of the import graph below ``cli``: it may use ``launch``, ``training`` and ``telemetry``;
none of them imports it.
"""
