"""``parallelism.strategy=fsdp`` end to end: real FSDP2 over gloo in local multi-process runs.

What fsdp must give is ddp's training, with each rank holding a shard of the state: the same losses
and gradient norms, checkpoints every rank writes its part of, an exact resume, a resume on another
world size, and the fallback to the previous checkpoint when a shard is damaged.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from train_helpers import refusal, run_train, train_command

# Small enough for 2 cores; clipping, accumulation and activation checkpointing all on, so the
# sharded gradient norm, the skipped reductions and recomputation inside sharded blocks are exercised.
SMALL = ["model=transformer", "data.demo_num_samples=384", "data.batch_size=8", "log_every_steps=1",
         "optim.clip_grad_norm=0.3", "optim.grad_accum_steps=2", "telemetry.enabled=false",
         "logger.tensorboard=false"]


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_train(*SMALL, *overrides, cache_dir=tmp_path.parent / "cache", run_dir=tmp_path / "run")


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def metrics(tmp_path: Path, run: str = "run") -> list[dict[str, Any]]:
    return [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()
            if "train_loss" in line]


def summary(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "run" / "summary.json").read_text())


def rank_logs(tmp_path: Path) -> str:
    return "".join(p.read_text() for p in (tmp_path / "run" / "submitit").glob("*_log.*"))


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp_follows_ddps_losses_and_gradient_norms(tmp_path: Path, world: int) -> None:
    """Tolerance: 1e-5 relative. The same arithmetic but summed in another order (reduce-scatter of
    shards vs one all-reduce); measured here: about 1e-8."""
    same = [f"parallelism.procs_per_node={world}", "optim.max_steps=10"]
    ok(train(tmp_path / "ddp", *same))
    ok(train(tmp_path / "fsdp", *same, "parallelism.strategy=fsdp", "memory.activation_checkpointing=true"))
    ddp, fsdp = metrics(tmp_path / "ddp"), metrics(tmp_path / "fsdp")
    assert [m["step"] for m in fsdp] == [m["step"] for m in ddp] == list(range(1, 11))
    for a, b in zip(ddp, fsdp, strict=True):
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (a, b)
    assert max(m["grad_norm"] for m in ddp) > 0.3, "the clip never bit: the test would not see a wrong norm"
    done = summary(tmp_path / "fsdp")
    assert done["world_size"] == world and len(set(done["param_checksum_per_rank"])) == 1
    shards = sorted(p.name for p in (tmp_path / "fsdp" / "run" / "checkpoints" / "step-000000010.dcp")
                    .glob("*.distcp"))
    assert shards == [f"__{r}_0.distcp" for r in range(world)], "every rank writes its own shard"


def test_an_fsdp_run_continued_in_place_ends_bit_identical(tmp_path: Path) -> None:
    same = ["parallelism.strategy=fsdp", "deterministic=true"]
    ok(train(tmp_path / "a", *same, "optim.max_steps=12"))
    ok(train(tmp_path / "b", *same, "optim.max_steps=5"))
    rest = ok(train(tmp_path / "b", *same, "optim.max_steps=12"))
    assert "resumed from" in rest.stdout + rank_logs(tmp_path / "b")
    a, b = summary(tmp_path / "a"), summary(tmp_path / "b")
    assert b["resumed_from"]["step"] == 5 and b["steps"] == a["steps"] == 12
    assert b["param_checksum_per_rank"] == a["param_checksum_per_rank"]
    assert [m["train_loss"] for m in metrics(tmp_path / "b")][5:] == \
        [m["train_loss"] for m in metrics(tmp_path / "a")][5:]


def test_an_async_fsdp_save_writes_what_a_blocking_one_writes(tmp_path: Path) -> None:
    """The background save (each rank's host copy of its shards, then DCP's write, the checksums and
    the publish on a gloo group of their own) writes the shards a blocking save writes, while the
    training goes on changing the weights, and both runs end bit-identical. DCP's ``.metadata``
    differs by its save id and path alone: its index of every tensor is compared instead."""
    same = ["parallelism.strategy=fsdp", "deterministic=true", "checkpoint.every_steps=3",
            "checkpoint.keep_last=5", "optim.max_steps=9"]
    ok(train(tmp_path / "sync", *same, "checkpoint.async_save=false"))
    ok(train(tmp_path / "async", *same, "checkpoint.async_save=true"))
    for step in (3, 6, 9):
        name = f"step-{step:09d}.dcp"
        written = {run: json.loads((tmp_path / run / "run" / "checkpoints" / name / "checksums.json")
                                   .read_text()) for run in ("sync", "async")}
        shards = {k: v for k, v in written["async"].items() if k.endswith(".distcp")}
        assert len(shards) == 2 and shards == {k: v for k, v in written["sync"].items()
                                               if k.endswith(".distcp")}
        index = {run: pickle.loads((tmp_path / run / "run" / "checkpoints" / name / ".metadata")
                                   .read_bytes()) for run in ("sync", "async")}
        assert index["sync"].state_dict_metadata == index["async"].state_dict_metadata
        assert index["sync"].storage_data == index["async"].storage_data
    a, b = summary(tmp_path / "sync"), summary(tmp_path / "async")
    assert a["param_checksum_per_rank"] == b["param_checksum_per_rank"]
    assert b["checkpoint_saves"] == a["checkpoint_saves"] == 3
    # A blocking save's wait is the whole save; the loop waited only for the copies of the first two
    # (and for the last, at the end, whole): less than the saves took, whatever the machine's speed.
    assert a["checkpoint_blocking_s"] >= a["checkpoint_save_s"]
    assert b["checkpoint_blocking_s"] < b["checkpoint_save_s"]
    assert not list((tmp_path / "async" / "run" / "checkpoints").glob(".step-*")), "no partial left behind"


def test_an_fsdp_checkpoint_of_4_ranks_resumes_on_2(tmp_path: Path) -> None:
    ok(train(tmp_path, "parallelism.strategy=fsdp", "parallelism.procs_per_node=4", "optim.max_steps=6"))
    four = summary(tmp_path)
    # Nothing left to train: the 2 ranks hold exactly the weights the 4 wrote (checksum of whole tensors).
    ok(train(tmp_path, "parallelism.strategy=fsdp", "parallelism.procs_per_node=2", "optim.max_steps=6"))
    loaded = summary(tmp_path)
    assert loaded["world_size"] == 2 and loaded["resumed_from"]["step"] == 6
    assert set(loaded["param_checksum_per_rank"]) == set(four["param_checksum_per_rank"])
    ok(train(tmp_path, "parallelism.strategy=fsdp", "parallelism.procs_per_node=2", "optim.max_steps=9"))
    continued = summary(tmp_path)
    assert continued["steps"] == 9 and len(set(continued["param_checksum_per_rank"])) == 1
    assert continued["final_train_loss"] is not None


def test_a_truncated_shard_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    checkpoints = ["parallelism.strategy=fsdp", "checkpoint.every_steps=4", "checkpoint.keep_last=2"]
    ok(train(tmp_path, *checkpoints, "optim.max_steps=8"))
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000000004.dcp", "step-000000008.dcp"]
    shard = folder / "step-000000008.dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short
    resumed = ok(train(tmp_path, *checkpoints, "optim.max_steps=10"))
    assert "warning: skipped unreadable checkpoint step-000000008.dcp: __1_0.distcp: checksum mismatch" \
        in resumed.stdout + resumed.stderr + rank_logs(tmp_path)
    done = summary(tmp_path)
    assert done["resumed_from"]["step"] == 4 and done["steps"] == 10
    assert "checksum mismatch" in done["checkpoint_warnings"][0]
    # The damaged checkpoint is pruned like any other; the newest two are whole.
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000000008.dcp", "step-000000010.dcp"]
    # A ddp run in the same directory is refused before submission, naming both strategies.
    refused = refusal(*SMALL, f"data.cache_dir={tmp_path.parent / 'cache'}", "checkpoint.every_steps=4",
                      "optim.max_steps=12", run_dir=tmp_path / "run")
    assert "parallelism.strategy: checkpoint 'fsdp', now 'ddp'" in refused


def test_fsdp_settings_it_cannot_use_are_refused_before_anything_runs(tmp_path: Path) -> None:
    refused = refusal(*SMALL, f"data.cache_dir={tmp_path.parent / 'cache'}", "parallelism.strategy=fsdp",
                      "parallelism.fsdp_units=[NoSuchBlock]")
    assert "parallelism.fsdp_units=['NoSuchBlock'] is invalid: model jobs.models.RowTransformer has no " \
           "module of these classes" in refused


def test_one_sweep_runs_ddp_and_fsdp_side_by_side_in_bf16(tmp_path: Path) -> None:
    """``parallelism.strategy=ddp,fsdp``: each point checked before anything runs, each trained with
    its own strategy; bf16 is autocast under ddp and FSDP2's policy under fsdp."""
    proc = run_train("parallelism.strategy=ddp,fsdp", "memory.amp=bf16", "optim.max_steps=12", *SMALL,
                     "hydra.launcher.registry=" + str(tmp_path / "registry.db"), multirun=True,
                     cache_dir=tmp_path / "cache", sweep_dir=tmp_path / "sweep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for point, kinds in (("0", [".pt", ".xxh3"]), ("1", [".dcp"])):
        done = json.loads((tmp_path / "sweep" / point / "summary.json").read_text())
        assert done["steps"] == 12 and len(set(done["param_checksum_per_rank"])) == 1
        losses = [m["train_loss"] for m in metrics(tmp_path / "sweep" / point, run="")]
        assert losses[-1] < 0.7 * losses[0], (point, losses)
        saved = (tmp_path / "sweep" / point / "checkpoints").glob("step-*")
        assert sorted({p.suffix for p in saved}) == kinds


def test_a_preempted_fsdp_run_checkpoints_its_shards_and_continues(tmp_path: Path) -> None:
    """SIGTERM (``switchyard cancel``, as SLURM's preemption): every rank stops at the same step and
    writes its shard; the run continues from that checkpoint."""
    registry = {**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")}
    proc = run_train("cluster=local", "cluster.wait=false", *SMALL, "parallelism.strategy=fsdp",
                     "optim.max_steps=1000000", multirun=True, cache_dir=tmp_path / "cache",
                     sweep_dir=tmp_path / "multirun", env=registry, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics_file = tmp_path / "multirun" / "0" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline, "the run never logged"
        time.sleep(0.2)
    switchyard = str(Path(sys.executable).parent / "switchyard")
    cancel = subprocess.run([switchyard, "cancel", "1", "--grace", "100"], env=registry,
                            capture_output=True, text=True, timeout=200)
    assert "cancelled 1 job(s)" in cancel.stdout, cancel.stdout + cancel.stderr
    saved = sorted((tmp_path / "multirun" / "0" / "checkpoints").glob("step-*.dcp"))
    assert len(saved) == 1 and sorted(p.name for p in saved[0].glob("*.distcp")) == \
        ["__0_0.distcp", "__1_0.distcp"]
    step = int(saved[0].name[5:14])
    logs = "".join(p.read_text() for p in (tmp_path / "multirun").rglob("*_0_log.out"))
    assert f"stopped by PREEMPTED at step {step}" in logs
    continued = ok(train(tmp_path, "parallelism.strategy=fsdp", f"optim.max_steps={step + 3}",
                         f"checkpoint.resume_from={saved[0].parent}"))  # the sweep point's
    assert f"resumed from {saved[0]} at step {step}" in continued.stdout + rank_logs(tmp_path)
    assert summary(tmp_path)["steps"] == step + 3


def test_an_fsdp_rank_killed_mid_run_fails_the_job_naming_it(tmp_path: Path) -> None:
    """kill -9 of one rank (the OOM killer) between gathers: the job fails naming that rank instead of
    leaving the other waiting in an all-gather until the collective timeout."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        train_command(*SMALL, "parallelism.strategy=fsdp", "optim.max_steps=1000000",
                      cache_dir=tmp_path / "cache", run_dir=run_dir),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics_file, rank_file = run_dir / "metrics.jsonl", run_dir / "telemetry" / "ranks" / "rank-1.json"
        deadline = time.monotonic() + 180
        while not (metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and proc.poll() is None, "the run never logged"
            time.sleep(0.2)
        os.kill(json.loads(rank_file.read_text())["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    assert "rank 1" in out + err and "SIGKILL" in out + err, (out + err)[-3000:]


BUILD_LOGGING_MODEL = '''
import os
from pathlib import Path

from torch._subclasses.fake_tensor import is_fake

from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """The built-in MLP, noting where each build put its weights: <pid>-<device type>, or fake (the
    submitting side's memory estimate: fake tensors hold no memory)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        where = "fake" if is_fake(self.head.weight) else self.head.weight.device.type
        (Path(os.environ["SWITCHYARD_TEST_BUILD_LOG"]) / f"{os.getpid()}-{where}").touch()
'''


WEIGHT_LOADING_MODEL = '''
import os
from pathlib import Path

import torch

from jobs.models import RowPoolingMLP

# where this module was imported: import-<pid> (a forked rank must import it itself, with its rank's
# environment, not inherit it from the process that forked it)
(Path(os.environ["SWITCHYARD_TEST_BUILD_LOG"]) / f"import-{os.getpid()}").touch()


class Net(RowPoolingMLP):
    """Refuses the meta device as from_pretrained does, and initialises its own weights (as a new
    head on pretrained weights is): each build notes <pid>-<count> = the head's weight sum."""

    def __init__(self, **kwargs):
        if torch.empty(0).is_meta:
            raise RuntimeError("You are using `from_pretrained` with a meta device context manager")
        super().__init__(**kwargs)
        log = Path(os.environ["SWITCHYARD_TEST_BUILD_LOG"])
        count = len(list(log.glob(f"{os.getpid()}-*")))
        (log / f"{os.getpid()}-{count}").write_text(repr(float(self.head.weight.sum())))
'''


def test_a_model_that_loads_its_weights_starts_alike_on_every_fsdp_rank(tmp_path: Path) -> None:
    """Such a model is built whole on every rank: what its factory initialises must come out the same
    everywhere, as no broadcast follows. Rank 0 used to build it twice (once on the host before
    trying the meta device), so its last build drew other random numbers than rank 1's."""
    (tmp_path / "weight_loading.py").write_text(WEIGHT_LOADING_MODEL)
    (tmp_path / "builds").mkdir()
    env = {**os.environ, "SWITCHYARD_TEST_BUILD_LOG": str(tmp_path / "builds"),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ok(run_train(*SMALL, "model=custom", "model._target_=weight_loading.Net", "parallelism.strategy=fsdp",
                 "parallelism.procs_per_node=2", "optim.max_steps=1", "memory.estimate=off",
                 cache_dir=tmp_path / "cache", run_dir=tmp_path / "run", env=env))
    ranks = [json.loads(p.read_text())["pid"]
             for p in (tmp_path / "run" / "telemetry" / "ranks").glob("rank-*.json")]

    def last_build(pid: int) -> str:
        builds = (tmp_path / "builds").glob(f"{pid}-*")
        return max(builds, key=lambda p: int(p.name.split("-")[1])).read_text()

    last = {pid: last_build(pid) for pid in ranks}
    assert len(ranks) == 2 and len(set(last.values())) == 1, last
    # the user's module is imported by each rank, after its fork: a module-level value read from the
    # rank's environment (a device from LOCAL_RANK) would otherwise be the forking process's, on
    # every rank
    assert all((tmp_path / "builds" / f"import-{pid}").exists() for pid in ranks)


def test_only_rank_0_holds_the_whole_model_on_the_host(tmp_path: Path) -> None:
    """The other ranks build on the meta device and receive their shards: 4 ranks of a node hold the
    weights once in host memory, not 4 times. The same weights as ddp's (see the ddp comparison)."""
    (tmp_path / "build_logging.py").write_text(BUILD_LOGGING_MODEL)
    (tmp_path / "builds").mkdir()
    env = {**os.environ, "SWITCHYARD_TEST_BUILD_LOG": str(tmp_path / "builds"),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ok(run_train(*SMALL, "model=custom", "model._target_=build_logging.Net", "parallelism.strategy=fsdp",
                 "parallelism.procs_per_node=4", "optim.max_steps=2", cache_dir=tmp_path / "cache",
                 run_dir=tmp_path / "run", env=env))
    ranks = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["pid"]
             for p in (tmp_path / "run" / "telemetry" / "ranks").glob("rank-*.json")}
    builds = {tuple(p.name.split("-")) for p in (tmp_path / "builds").iterdir()}
    # the ranks' builds (the submitting process runs a model this small on the host for its check)
    on_host = sorted(int(pid) for pid, device in builds if device == "cpu" and int(pid) in ranks.values())
    assert on_host == [ranks[0]], f"weights built on the host by {on_host}; ranks: {ranks}"
    assert all((str(ranks[r]), "meta") in builds for r in range(4))
