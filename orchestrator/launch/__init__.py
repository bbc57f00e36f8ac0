"""How ranks are started and find each other.

- ``dist_env``: the one reader of SLURM's, torchrun's and submitit's variables -> a frozen ``DistEnv``;
- ``rendezvous``: rank 0 publishes a free port in the job's directory, the others read it;
- ``submit``: a config -> a submitit executor (debug, local or SLURM), the job's result, its failure
  explained (which rank, which node, the tail of its log);
- ``local_jobs``: process control of local jobs (fail-fast, cancel as ``scancel`` does);
- ``slurm_query``: batched ``sacct``/``squeue`` reads;
- ``single``: a single job recorded in the registry (as a sweep of one), followed while it pends,
  and its end recorded.

It imports the ``registry`` and nothing of ``training``, ``telemetry`` or ``sweeps``.
"""
