"""Per-GPU and per-rank memory telemetry: preflight, a sampler per node, the run's summary and its plot.

Two mistakes cost whole allocations and show only in hindsight: a "multi-GPU" job whose ranks all run
on GPU 0 (the others idle), and GPU 0 holding several GiB more than its peers because every rank
loaded something onto ``cuda:0``. This package makes both visible while the job runs and flags them
in the summary. One module per step, in the order a run meets them:

- ``nvml``: NVML behind one :class:`~orchestrator.telemetry.nvml.NvmlApi`, and which GPUs a process sees;
- ``files``: what each rank writes under ``RUN/telemetry/`` (who it is at start, its peak at the end);
- ``preflight``: before the process group starts, the node's GPUs against the job's request;
- ``sampler``: the thread on local rank 0 of each node that records memory over time;
- ``stats``: the samples read back, per GPU and per rank;
- ``fold``: what the sampler folds as it samples and writes beside them (statistics, a bounded
  series), which is all ``switchyard status`` and ``plot`` read;
- ``flags``: idle GPUs, GPU 0 overload, a rank on another rank's GPU, a rank's private memory;
- ``summary``: ``summary.json["memory"]`` and its text for ``switchyard status``;
- ``plot``: ``switchyard plot``.

``common`` holds the record type, byte units, errors and number formats they share.
"""
