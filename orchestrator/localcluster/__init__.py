"""A real two-node SLURM cluster on this machine (``switchyard cluster up/status/down``), in ``cluster``.

Self-contained: it imports nothing else of ``orchestrator``.
"""
