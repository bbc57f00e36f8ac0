"""Hydra sweeps as SLURM job arrays (or local processes), and what was submitted.

- ``launcher``: the logic behind Switchyard's Hydra launcher (check, record, submit, wait), over
  - ``points``: each point composed, resolved, checked, and its files written;
  - ``arrays``: resources, SLURM's limits, grouping into arrays, submit and resubmit;
  - ``node``: what a point's job runs on the node (``run_point``);
- ``results``: what each job shows (progress, loss, memory), kept in the registry once it ended;
- ``status``: ``switchyard status/show/logs/cancel/resubmit``.

Within the package imports run one way, ``launcher`` and ``status`` on top: neither imports the
other (``tests/test_architecture.py``).

The top of the import graph below ``cli``: it may use ``registry`` (the SQLite record of sweeps,
jobs and attempts), ``launch``, ``training`` and ``telemetry``;
none of them imports it.
"""
