"""What each rank does, once it runs.

- ``trainer``: the rank's entry point (``train_rank``) and the training loop: loaders, model,
  optimizer, evaluation, metrics, the summary;
- ``runtime``: the device and the process group, DDP wrapping, reductions over ranks;
- ``checkpoint``: atomic save, newest-readable load;
- ``preemption``: SIGUSR2/SIGTERM to a flag all ranks agree on at a step boundary, then requeue.

It may use ``launch`` (who am I, where is rank 0) and ``telemetry``; it never imports ``sweeps``.
"""
