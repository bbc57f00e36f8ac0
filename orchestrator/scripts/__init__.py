"""Your own code as a Switchyard job: a command (``switchyard run -- python train.py``) or a Python
function (``switchyard.submit``) run as every rank, with the same cluster and parallelism groups,
run directory, telemetry, fail-fast, requeue and registry as ``jobs.train``.

- ``schema``: ``RunConfig``, the config of ``switchyard run`` (``conf/run.yaml``);
- ``rank``: what each rank's Switchyard process does around the user's process;
- ``job``: the submitting side (checks, sbatch script, registry entry, waiting, the report).

It imports ``launch``, ``telemetry`` and the ``registry``, never ``training``: a script's job does
not load the trainer.
"""
