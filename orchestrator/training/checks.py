"""Everything that can fail on the nodes and can be known before submission, checked here.

The dataset against the task (fields, dtypes, shapes, label ranges from the manifest), the model's
constructor against its config, one real example batch through the model and the task's loss on
the meta device (the shape errors a model would hit on every rank after a queue wait), the file
system, this machine's GPUs and shared memory, and what SLURM would say of the request.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from orchestrator.config import ConfigError, TrainConfig, group_dict
from orchestrator.launch import slurm_request, submit
from orchestrator.training import estimate, exporting, resume, run_log, strategy
from orchestrator.training.eval_data import check_eval_matches
from orchestrator.training.step import build_model, build_model_on_meta
from orchestrator.training.tasks import Batch, Task, build_task
from orchestrator.training.trainer import DataPaths
from sharding import DatasetError, ShardedDataset, open_dataset
from sharding.loader import RankDataset, check_shared_memory, ring_bytes

# Models above this size are not built on the CPU to run the example batch when the meta device
# cannot run them (a data-dependent branch): their check is left to the first step.
CPU_EXAMPLE_MAX_PARAMETERS = 50_000_000
# Parameters x samples up to which the example batch runs on the host with real weights instead of
# on meta: torch's first meta-device call imports its decompositions, sympy and torch._dynamo
# (about a second of CPU), while a model this small builds and runs a batch in milliseconds. The
# host run checks more, too: values (an out-of-range class or token id), not only shapes.
HOST_EXAMPLE_MAX = 20_000_000
# Samples in the CPU run's batch (the meta run takes data.batch_size): at least two, for BatchNorm
# in train mode, and few, as its activations are real memory on this machine.
CPU_EXAMPLE_SAMPLES = 2


def check_before_submit(cfg: TrainConfig, paths: DataPaths, run_dir: Path | None = None
                        ) -> estimate.MemoryReport | None:
    """Raises ConfigError on the first problem; returns the memory estimate (None when
    ``memory.estimate=off``), which has refused a step too large for the GPU already. With the
    run directory, the resume the ranks would make (``resume.check_before_submit``)."""
    task = build_task(cfg.task, cfg.data)
    train = open_checked("data.path", paths.train)
    task.setup(train)
    task.check_dataset("data.path", train)
    if paths.eval is not None:
        held_out = open_checked("data.eval_path", paths.eval)
        check_eval_matches(train, held_out)  # first: another tokenizer's ids say nothing of ours
        task.check_dataset("data.eval_path", held_out)
    check_sampling(cfg, task, train)
    if cfg.checkpoint.dir:
        check_writable_dir("checkpoint.dir", Path(cfg.checkpoint.dir).expanduser())
    if run_dir is not None:
        current = resume.compatibility(cfg, task.model_kwargs(train), train.fingerprint)
        resume.check_before_submit(cfg, run_dir, current)
    if cfg.cluster.mode != "slurm" and task.source(train) is None:  # this machine's /dev/shm is theirs
        check_worker_memory(paths, cfg)
    run_log.check_available(cfg.logger)
    estimate.check_bf16(cfg)
    if cfg.cluster.mode == "slurm":  # milliseconds, before the seconds of the model's and memory's
        slurm_request.check(submit.slurm_parameters(cfg.cluster, cfg.parallelism),
                            slurm_request.config_keys(cfg.parallelism))
    check_model(cfg, task, train)
    memory = estimate.check_memory(cfg, task, train, example_batch(task, train))
    if cfg.cluster.mode != "slurm" and cfg.parallelism.gpus_per_node > torch.cuda.device_count():
        raise ConfigError(f"parallelism.gpus_per_node={cfg.parallelism.gpus_per_node} is invalid: this "
                          f"machine has {torch.cuda.device_count()} GPUs (try parallelism.gpus_per_node="
                          f"{torch.cuda.device_count()})")
    return memory


def check_sampling(cfg: TrainConfig, task: Task, train: ShardedDataset) -> None:
    """The sampler's and the loader's refusals, which otherwise come from every rank after the
    queue wait: ``data.policy=drop`` over more ranks than samples (each rank would get none), and
    ``data.group_by_length`` on data whose every field has one length (nothing to group by)."""
    source = task.source(train)  # a language model reads windows, never grouped by length
    counts = train.shard_counts if source is None else source.shard_counts
    num_samples, world_size = sum(counts), cfg.parallelism.world_size
    if cfg.data.policy == "drop" and num_samples < world_size:
        what = "sample" if source is None else f"window of data.seq_len={cfg.data.seq_len}"
        many = "" if num_samples == 1 else "s"
        raise ConfigError(f"data.policy=drop is invalid: data.path={str(train.root)!r} has "
                          f"{num_samples} {what}{many} for {world_size} ranks, so every rank would get "
                          f"none (try data.policy=pad, which pads with flagged samples, or at most "
                          f"{num_samples} rank{many})")
    if cfg.data.group_by_length and source is None and set(train.schema) <= train.fixed_fields:
        raise ConfigError(f"data.group_by_length=true is invalid: every field of data.path="
                          f"{str(train.root)!r} has one shape in every sample ({fixed_shapes(train)}), "
                          f"so there is no length to group by (try data.group_by_length=false)")


def fixed_shapes(ds: ShardedDataset) -> str:
    """``x: float32[8, 16], y: int64[]``: each field's shape with its (single) leading size."""
    stats = ds.manifest.field_stats
    shapes = {name: [stats[name].min_leading if d is None else d for d in spec.shape]
              for name, spec in ds.schema.items()}
    return ", ".join(f"{name}: {spec.dtype}{shapes[name]}" for name, spec in ds.schema.items())


def open_checked(key: str, path: str) -> ShardedDataset:
    try:
        return open_dataset(path)
    except DatasetError as e:
        raise ConfigError(f"{key}={path!r} cannot be opened: {e}") from e


def check_model(cfg: TrainConfig, task: Task, train: ShardedDataset) -> None:
    """The constructor takes its config, fsdp finds units to shard, and one real batch of the
    training data (``data.batch_size`` samples, as few as it holds) goes through the model and the
    task's loss in train mode. On the meta device: no weights are allocated, no arithmetic is
    done, and shapes are checked as on the ranks; a small model (``HOST_EXAMPLE_MAX``) runs it on
    the host instead, with real weights. A factory that loads weights (``from_pretrained``
    refuses the meta device) is built on the host and run on two samples. Whatever the model
    raises is one refusal naming it: a new exception type (an AttributeError) was a traceback."""
    kwargs = task.model_kwargs(train)
    try:
        model = build_model_on_meta(cfg.model, kwargs, cfg.memory)
    except ConfigError:
        raise  # a ValueError too: build_model's own refusal, already one line
    except (RuntimeError, ValueError, OverflowError) as e:  # model.hidden_dim=-1: torch refuses it
        spec = {k: v for k, v in group_dict(cfg.model).items() if k != "_target_"}
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model._target_={group_dict(cfg.model).get('_target_')!r} cannot be built "
                          f"with its config ({', '.join(f'model.{k}={v!r}' for k, v in spec.items())}): "
                          f"{first} (fix the model.* value)") from e
    exporting.check_exportable(cfg.checkpoint, model)  # checkpoint.export=hf of a model it cannot write
    if cfg.parallelism.strategy == "fsdp":  # what it would shard: nothing is refused here
        strategy.shard_units(model, cfg.parallelism.fsdp_units)
    if any(not p.is_meta for p in model.parameters()):  # its factory loaded weights: two samples
        example = example_batch(task, train, min(cfg.data.batch_size, CPU_EXAMPLE_SAMPLES))
        try:
            return run_example(task, model, example)
        except ConfigError:
            raise
        except Exception as e:
            raise refused(cfg, example, e) from e
    example = example_batch(task, train, cfg.data.batch_size)
    if sum(p.numel() for p in model.parameters()) * len(next(iter(example.values()))) <= HOST_EXAMPLE_MAX:
        try:  # a small model: the real batch on the host costs less than meta's first call
            return run_example(task, build_model(cfg.model, kwargs, cfg.memory), example)
        except ConfigError:
            raise
        except Exception as e:
            raise refused(cfg, example, e) from e
    try:
        run_example(task, model, {k: v.to("meta") if k in task.fields() else v for k, v in example.items()})
    except ConfigError:
        raise  # the task's own refusal (an output it cannot read) names the fix already
    except Exception as e:
        if not meta_cannot_run(e):
            raise refused(cfg, example, e) from e
        if sum(p.numel() for p in model.parameters()) <= CPU_EXAMPLE_MAX_PARAMETERS:
            try:  # a data-dependent branch: a batch on the CPU, with real (small) weights
                small = example_batch(task, train, min(cfg.data.batch_size, CPU_EXAMPLE_SAMPLES))
                run_example(task, build_model(cfg.model, kwargs, cfg.memory), small)
            except ConfigError:
                raise
            except Exception as cpu_error:
                raise refused(cfg, small, cpu_error) from cpu_error


def example_batch(task: Task, ds: ShardedDataset, batch_size: int = 1) -> Batch:
    """The first ``batch_size`` samples (or windows) of ``ds``, as many as it holds, as one batch
    on the host: BatchNorm in train mode needs more than one value per channel, so a batch of one
    refused every ResNet."""
    source = task.source(ds)
    data = RankDataset(ds) if source is None else source
    available = sum(ds.shard_counts if source is None else source.shard_counts)
    return data.__getitems__(list(range(max(1, min(batch_size, available)))))


def run_example(task: Task, model: nn.Module, batch: Batch) -> None:
    model.train()
    output = task.forward(model, batch)
    task.loss_sums(output, batch)


def meta_cannot_run(error: BaseException) -> bool:
    """A model that reads a value on the host (``.item()``, ``if x.any()``) cannot run on meta."""
    return isinstance(error, NotImplementedError) or "meta" in str(error).lower()


def refused(cfg: TrainConfig, example: Batch, error: BaseException) -> ConfigError:
    target = group_dict(cfg.model).get("_target_")
    shapes = ", ".join(f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
                       for k, v in example.items() if isinstance(v, torch.Tensor))
    text = str(error).strip()
    first = f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
    return ConfigError(f"model._target_={target!r} fails on one real batch of data.path ({shapes}): "
                       f"{first} (fix the model for this input, or choose the task and fields that "
                       f"fit it)")


def check_worker_memory(paths: DataPaths, cfg: TrainConfig) -> None:
    """The worker batch rings of every rank on this machine (train and eval loaders at once) fit in
    /dev/shm: known now, not as ENOSPC in the first epoch. On SLURM each rank's loader checks its
    node's /dev/shm itself, before allocating."""
    needed = sum(ring_bytes(RankDataset(path), cfg.data.batch_size, cfg.data.num_workers)
                 for path in (paths.train, paths.eval) if path is not None)
    try:
        check_shared_memory(needed, cfg.data.batch_size, cfg.data.num_workers,
                            ranks=cfg.parallelism.world_size)
    except DatasetError as e:
        raise ConfigError(str(e)) from e


def check_writable_dir(key: str, path: Path) -> None:
    """``path`` is, or can become, a directory this user writes: known now, not at the first save
    at the end of training. Creates nothing."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it" if existing == path else f"{existing} (on its path)"
        raise ConfigError(f"{key}={str(path)!r} is invalid: {where} is a file, not a directory "
                          f"(try {key}=<a directory>)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={str(path)!r} is invalid: {existing} is not writable by this user "
                          f"(try {key}=<a directory you can write>)")
