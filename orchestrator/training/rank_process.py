"""The rank process around the trainer: its start-up (locks, preflight, the process group, the
heartbeat, the node's memory sampler) and its shutdown (peaks, the summary, the process group).

``train_rank`` is what each rank runs: submitted through submitit in every mode, or called in place
when attached to the user's own srun or torchrun.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from durable import atomic
from orchestrator.config import ConfigError, TrainConfig
from orchestrator.launch import dist_env, hang_dumps, rank_env, rendezvous, restarts, run_lock, submit
from orchestrator.launch.heartbeat import Heartbeat, interval_for
from orchestrator.telemetry.files import clear_end_summary, register_rank
from orchestrator.telemetry.preflight import preflight
from orchestrator.training import memory_report, resume, runtime, startup
from orchestrator.training.trainer import DataPaths, Trainer
from sharding import lease

# What every rank imports before its first step: this module and the trainer, and the
# ``torch._dynamo`` DDP's constructor imports; fsdp's stack where the run shards.
# numpy.ma: numpy imports it at the first np.unique (the sampler's partition), about 30 ms a rank
RANK_MODULES = (__name__, "torch._dynamo", "numpy.ma")
FSDP_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")
ALL_RANK_MODULES = (*RANK_MODULES, *FSDP_MODULES)


def rank_modules(cfg: TrainConfig) -> tuple[str, ...]:
    """What a rank imports before its first step, for a local job's controller to import once and
    fork its ranks from (``orchestrator.launch.fork_start``). Never the user's ``model._target_``
    module: imported before the fork, a module-level value it read from the environment (a device
    from ``LOCAL_RANK``) would be the forking process's on every rank."""
    return (*RANK_MODULES, *(FSDP_MODULES if cfg.parallelism.strategy == "fsdp" else ()))


def train_rank(cfg: TrainConfig, paths: DataPaths, run_dir: str) -> dict[str, Any]:
    """One rank's run, start to summary.

    Rank 0 holds the run directory's lock, and the checkpoint directory's, for the whole run
    (``run_lock``), and a lease on each dataset it reads (``sharding.lease``). Preflight runs
    before the process group, so a GPU-count mismatch fails in seconds instead of after the
    rendezvous; one memory sampler per node (local rank 0) runs for the whole job.
    """
    env, run = dist_env.detect(), Path(run_dir)
    with contextlib.ExitStack() as held:
        if env.is_main:
            owner = f"job {env.job_id} (rank 0, pid {os.getpid()} on {env.hostname})"
            with before_rendezvous(env, run):
                held.enter_context(run_lock.hold(run, owner))
                checkpoints = resume.checkpoint_dir(cfg, run)
                if checkpoints.resolve() != run.resolve():
                    held.enter_context(run_lock.hold(checkpoints, owner, "checkpoint.dir"))
            # a lease on each dataset it reads: jobs.prepare overwrite=true refuses, naming this run
            for dataset in {paths.train, paths.eval} - {None}:
                held.enter_context(lease.hold(str(dataset), f"{owner}, run directory {run}"))
        return _train_rank(cfg, paths, run, env)


@contextlib.contextmanager
def before_rendezvous(env: dist_env.DistEnv, run: Path) -> Iterator[None]:
    """Rank 0 failing here tells the ranks waiting for its address, so they stop with its reason."""
    try:
        yield
    except ConfigError as e:
        rendezvous.publish_failure(rendezvous.endpoint_file(run / "rendezvous", env), str(e))
        raise


def _train_rank(cfg: TrainConfig, paths: DataPaths, run: Path, env: dist_env.DistEnv) -> dict[str, Any]:
    clock = startup.Clock()
    clock.mark("imports")  # the interpreter, the imports and submitit's unpickling: all before here
    if cfg.deterministic:  # first: cuBLAS takes its workspace setting when the rank first uses CUDA
        runtime.enable_determinism()
    uuids = runtime.cuda_uuids(cfg.parallelism.gpus_per_node)  # NVML finds the GPUs by UUID
    report = preflight(cfg.parallelism.gpus_per_node, env.local_rank, env.local_world_size, cuda_uuids=uuids)
    print(report.describe(), flush=True)
    register_rank(run, env.rank, env.local_rank, env.hostname, report.device_index,
                  device_uuid=runtime.device_uuid(uuids, report.device_index))
    clock.mark("preflight")
    if env.is_main:
        clear_end_summary(run)
        hang_dumps.clear(run)
    sampler = memory_report.node_sampler(cfg, run, env, uuids)
    os.environ.update(hang_dumps.recorder_environment(run))  # before the process group starts
    rt = runtime.start(env, cfg.parallelism, cfg.cluster, run / "rendezvous", report.device_index, run)
    clock.mark("rendezvous")
    runtime.check_bf16(rt.device, cfg.memory.amp)  # where submission could not name the GPU
    runtime.set_tf32(rt.device, cfg.memory.tf32)
    dumper = hang_dumps.Dumper(run, env.rank, env.world_size, env.hostname)
    interval_s = interval_for(cfg.cluster.collective_timeout_s)
    pulse = Heartbeat(run, env.rank, env.hostname, interval_s, watch=dumper.poll)
    try:
        with pulse, rank_env.exported(env, run / "rendezvous"):  # torchrun's variables for the user's code
            with sampler or contextlib.nullcontext():
                rank_trainer = Trainer(cfg, paths, run, rt, pulse, clock)
                runtime.report_nccl_transport(rt)  # the model's broadcast has connected NCCL
                summary = rank_trainer.run()
            pulse.mark(summary["steps"], "done")
            memory_report.record_peaks(run, env, report.device_index, rank_trainer.peaks)
            torch.distributed.barrier()  # every node's sampler has stopped and every peak is written
        if rt.is_main:
            finish(run, summary, clock)
        return summary
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
        timed_out, lost = hang_dumps.is_collective_timeout(said), submit.lost_a_peer(said)
        if timed_out:  # where was everyone?
            dumper.on_timeout(pulse.step, pulse.phase, e, wait_s=3 * interval_s + 2)
        elif lost:  # gloo closes a pair when its collective times out: was it one?
            dumper.on_peer_lost(pulse.step, pulse.phase, e, wait_s=3 * interval_s + 2)
        restarts.record_failure(env.rank, pulse.step, e, consequence=timed_out or lost)
        if env.is_main and cfg.telemetry.enabled:
            memory_report.keep_end_summary(run)
        raise
    finally:
        runtime.stop()


def finish(run: Path, summary: dict[str, Any], clock: startup.Clock) -> None:
    """Rank 0: the memory section and the start-up and ending seconds into summary.json."""
    summary.update(memory_report.for_summary(run))
    clock.mark("result")
    summary["startup_s"], summary["ending_s"] = clock.startup_s(), clock.ending_s()
    print(startup.describe(summary["startup_s"]), flush=True)
    write_summary(run, summary)
    memory_report.print_flags(summary["memory"])


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    atomic.write_json(run_dir / "summary.json", summary, indent=2)
