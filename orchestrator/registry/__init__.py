"""The registry: what was submitted, single jobs and sweeps alike, and what became of it.

- ``db``: the SQLite file of sweeps, their jobs and every attempt at each, and its migrations;
- ``states``: the state vocabulary of an attempt, and which state may follow which;
- ``status_file``: what an attempt's rank 0 writes on its node instead of opening the database;
- ``reconciliation``: SLURM's answers and the status files -> the attempts' states.

A single job is recorded as a sweep of one job (``db.SINGLE_NUM``) with no saved sweep entry.

Below ``launch`` and ``sweeps``, which both record into it: it imports neither.
"""
