"""``switchyard.submit``: a Python function as every rank of a job (see
``orchestrator.scripts.function`` for what happens around it)::

    import switchyard

    def train(lr):
        import torch.distributed as dist
        dist.init_process_group("gloo")     # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are set
        ...
        return dist.get_rank()

    job = switchyard.submit(train, 1e-3, overrides=["cluster=slurm", "parallelism.nodes=2"])
    job.status                               # PENDING, RUNNING, COMPLETED, ...
    job.result()                             # [0, 1, 2, 3]: each rank's return value
    job.cancel()
"""

from __future__ import annotations

from orchestrator.scripts.function import FunctionJob as Job
from orchestrator.scripts.function import submit_function as submit

__all__ = ["Job", "submit"]
