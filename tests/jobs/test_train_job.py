"""The training job end to end, without SLURM: local multi-process DDP and debug mode."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from rank_helpers import rank_processes
from train_helpers import CHEAP, refusal, run_train

from orchestrator.launch.dist_env import DistEnv
from orchestrator.training import runtime

# Small enough to finish in seconds on 2 cores, big enough that the loss visibly drops.
SMALL = ["optim.max_steps=40", "data.demo_num_samples=512", "data.batch_size=16", "log_every_steps=5"]


def demo_cache(tmp_path: Path) -> Path:
    """Beside every test's own directory: the demo data is generated once per test run (and per
    pytest-xdist worker), under a file lock, and only read after."""
    return tmp_path.parent / "demo-cache"


def train(tmp_path: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return run_train(*SMALL, *overrides, cache_dir=demo_cache(tmp_path), run_dir=tmp_path / "run")


def refused(tmp_path: Path, *overrides: str) -> str:
    """What ``train(tmp_path, *overrides)`` would print on stderr as it refuses, found in this process."""
    return refusal(*SMALL, f"data.cache_dir={demo_cache(tmp_path)}", *overrides)


def read_summary(run_dir: Path) -> dict:  # type: ignore[type-arg]
    return json.loads((run_dir / "summary.json").read_text())


def first_logged_loss(run_dir: Path) -> float:
    return float(json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["train_loss"])


def check_ddp_summary(summary: dict, world: int) -> None:  # type: ignore[type-arg]
    assert summary["world_size"] == world
    assert len(set(summary["samples_per_rank"])) == 1 or world == 1
    assert len(set(summary["batches_per_rank"])) == 1
    assert len(set(summary["param_checksum_per_rank"])) == 1, "ranks ended with different weights"
    assert summary["eval_samples_counted"] == summary["eval_set_size"] == 128
    assert len(summary["peak_mem_bytes_per_rank"]) == world


def test_local_two_ranks_train_and_agree(tmp_path: Path) -> None:
    proc = train(tmp_path, "telemetry.interval_s=0.2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "run"
    assert f"run_dir: {run_dir}" in proc.stdout
    summary = read_summary(run_dir)
    check_ddp_summary(summary, 2)
    assert summary["final_train_loss"] < 0.7 * first_logged_loss(run_dir)
    assert list((run_dir / "checkpoints").glob("step-*.pt"))
    # Where the seconds before the first step and after the last went, phase by phase, in order.
    startup, ending = summary["startup_s"], summary["ending_s"]
    assert list(startup) == ["imports", "preflight", "rendezvous", "data", "model", "resume",
                             "first_step", "to_first_step"]
    assert all(v >= 0 for v in startup.values()) and startup["imports"] > 0
    assert sum(v for k, v in startup.items() if k != "to_first_step") == \
        pytest.approx(startup["to_first_step"], abs=0.01)
    assert list(ending) == ["final_checkpoint", "result", "after_last_step"]
    assert "start-up: " in (run_dir / "submitit").joinpath(
        next(p.name for p in (run_dir / "submitit").glob("*_0_log.out"))).read_text()
    # No NVIDIA driver here: the same telemetry files, with each rank's CPU memory instead.
    memory = summary["memory"]
    assert memory["mode"] == "cpu" and memory["num_samples"] >= 2 and memory["flags"] == []
    assert sorted(r["rank"] for r in memory["ranks"]) == [0, 1]
    assert all(r["peak_rss_bytes"] > 0 for r in memory["ranks"])
    plot = subprocess.run([str(Path(sys.executable).parent / "switchyard"), "plot", str(run_dir)],
                          capture_output=True, text=True)
    assert plot.returncode == 0, plot.stderr
    assert Path(plot.stdout.strip()).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_config_in_debug_mode(tmp_path: Path) -> None:
    """20 steps of 2 batches cross the epoch of 32 batches that one rank reads (the loss is the
    two-rank test's concern): a bf16 transformer with activation checkpointing is slow on a CPU."""
    proc = train(tmp_path, "cluster=debug", "model=transformer", "memory.amp=bf16",
                 "memory.activation_checkpointing=true", "optim.grad_accum_steps=2", "optim.max_steps=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "run")
    check_ddp_summary(summary, 1)
    assert summary["steps"] == 20 and summary["batches_per_rank"] == [40]


@pytest.mark.parametrize(("override", "message"), [
    ("data.path=/nonexistent", "data.path='/nonexistent' is invalid: no dataset there"),
    ("data.input_field=nope", "data.input_field='nope' is invalid"),
    ("parallelism.gpus_per_node=2", "parallelism.gpus_per_node=2 is invalid: this machine has 0 GPUs"),
    ("memory.amp=fp8", "memory.amp='fp8' is invalid"),
    ("model=custom", "model._target_ is missing: it has no default (try model._target_=<value>"),
    ("model=custom model._target_=nope.Net", "model._target_='nope.Net' cannot be imported"),
    ("+optim.lrr=1e-3", "optim.lrr=0.001 is invalid: optim has no key 'lrr', so nothing would read it "
                        "(try optim.lr=...)"),
    ("+model.hidden_dimm=8", "model.hidden_dimm=8 is invalid: model has no key 'hidden_dimm'"),
    ("log_every_steps=0", "log_every_steps=0 is invalid: must be >= 1"),
    ("seed=-1", "seed=-1 is invalid: must be >= 0"),
    ("checkpoint.dir=/proc/version/ckpt", "checkpoint.dir='/proc/version/ckpt' is invalid: /proc/version "
                                          "(on its path) is a file"),
    ("cluster=local parallelism.nodes=2 parallelism.gpus_per_node=1",
     "parallelism.nodes=2 is invalid: GPUs in cluster=local run on this machine, one rank per GPU"),
])
def test_bad_input_fails_before_submitting(tmp_path: Path, override: str, message: str) -> None:
    """In this process: ``jobs.train`` checks all of it before it builds the executor."""
    error = refused(tmp_path, *override.split(), "data.num_classes=4")
    assert message in error


def test_a_refusal_is_one_line_and_exit_code_2_and_submits_nothing(tmp_path: Path) -> None:
    """The refusals above, as ``python -m jobs.train`` tells them."""
    proc = train(tmp_path, "data.input_field=nope", "data.num_classes=4")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip() == refused(tmp_path, "data.input_field=nope", "data.num_classes=4")
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error: ")
    assert not (tmp_path / "run" / "submitit").exists(), "nothing may be submitted"


def _agree_worker(rank: int, store_path: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, num_nodes=1,
                  master_addr="127.0.0.1", hostname="here", job_id="t", restart_count=0, source="local")
    rt = runtime.Runtime(env=env, device=__import__("torch").device("cpu"), backend="gloo")
    try:
        runtime.agree(rt, batches_per_epoch=10 + rank, train_fingerprint="abc")
        out.put((rank, "agreed"))
    except runtime.StartupMismatchError as e:
        out.put((rank, str(e)))
    dist.destroy_process_group()


def test_ranks_that_disagree_all_stop_with_one_clear_error(tmp_path: Path) -> None:
    ctx = rank_processes()
    out = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, str(tmp_path / "store"), out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    for rank in (0, 1):
        assert "ranks disagree before the first step" in results[rank]
        assert "rank 0: batches_per_epoch=10" in results[rank]
        assert "rank 1: batches_per_epoch=11" in results[rank]


def test_a_stopped_run_continued_in_place_ends_bit_identical(tmp_path: Path) -> None:
    """Three ranks: the smallest world where gloo's summation order can change a result, so this
    fails if a resumed process's first step used a different DDP bucket layout than the original.
    Dropout: the masks after the resume are the uninterrupted run's only if nothing but the model
    draws from the restored generator (a DataLoader's new iterator drew its seed from it)."""
    same = ["model=transformer", "model.dropout=0.1", "parallelism.procs_per_node=3", "deterministic=true",
            "log_every_steps=1", *CHEAP]
    straight = train(tmp_path / "a", *same, "optim.max_steps=24")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first_half = train(tmp_path / "b", *same, "optim.max_steps=9")
    assert first_half.returncode == 0, first_half.stderr[-3000:]
    rest = train(tmp_path / "b", *same, "optim.max_steps=24")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert "resumed from" in rest.stdout + "".join(
        p.read_text() for p in (tmp_path / "b" / "run" / "submitit").glob("*_0_log.out"))
    a, b = read_summary(tmp_path / "a" / "run"), read_summary(tmp_path / "b" / "run")
    assert b["steps"] == a["steps"] == 24
    assert b["param_checksum_per_rank"] == a["param_checksum_per_rank"]


def test_a_changed_checkpoint_is_skipped_on_the_terminal_and_in_the_summary(tmp_path: Path) -> None:
    checkpoints = ["checkpoint.every_steps=10", "checkpoint.keep_last=3", "telemetry.enabled=false"]
    assert train(tmp_path, *checkpoints, "optim.max_steps=20").returncode == 0
    newest = tmp_path / "run" / "checkpoints" / "step-000000020.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2:len(data) // 2 + 512] = b"\x7f" * 512  # a stray write inside the file
    newest.write_bytes(bytes(data))
    resumed = train(tmp_path, *checkpoints, "optim.max_steps=30")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "warning: skipped unreadable checkpoint step-000000020.pt: CheckpointError: checksum " \
           "mismatch" in resumed.stderr
    assert "checkpoints/step-000000010.pt at step 10" in resumed.stdout
    summary = read_summary(tmp_path / "run")
    assert summary["resumed_from"]["step"] == 10 and summary["steps"] == 30
    assert "checksum mismatch" in summary["checkpoint_warnings"][0]
    # Run again: nothing left to train, so there is no train loss; the summary stays strict JSON.
    again = train(tmp_path, *checkpoints, "optim.max_steps=30")
    assert again.returncode == 0, again.stderr[-3000:]

    def no_nan(constant: str) -> None:
        raise AssertionError(f"summary.json holds {constant}")

    strict = json.loads((tmp_path / "run" / "summary.json").read_text(), parse_constant=no_nan)
    assert strict["final_train_loss"] is None and strict["resumed_from"]["step"] == 30


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    """A crash cut the newest checkpoint short: the rerun in the same directory resumes from the one
    before and says which it skipped (once a SLURM test: what it checks is the resume, not SLURM)."""
    every = ["checkpoint.every_steps=10", "log_every_steps=5", *CHEAP]
    first = train(tmp_path, *every, "optim.max_steps=20")
    assert first.returncode == 0, first.stderr[-3000:]
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*.pt"))
    assert [p.name for p in checkpoints] == ["step-000000010.pt", "step-000000020.pt"]
    checkpoints[-1].write_bytes(checkpoints[-1].read_bytes()[:1000])
    again = train(tmp_path, *every, "optim.max_steps=30")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "warning: skipped unreadable checkpoint step-000000020.pt" in again.stderr
    assert "checkpoints/step-000000010.pt at step 10" in again.stdout
    assert read_summary(tmp_path / "run")["steps"] == 30


def test_fixed_length_inputs_train_and_evaluate(tmp_path: Path) -> None:
    """Every sample 8 rows: the loader stacks x and makes no x_mask; the model sees all rows as real."""
    import numpy as np

    from sharding import DatasetWriter

    rng = np.random.default_rng(0)
    for name, count in (("train", 256), ("eval", 64)):
        with DatasetWriter(tmp_path / name) as writer:
            for i in range(count):
                x = rng.normal(size=(8, 16)).astype(np.float32) + i % 4
                writer.append({"x": x, "y": np.int64(i % 4)})
    proc = train(tmp_path, f"data.path={tmp_path / 'train'}", f"data.eval_path={tmp_path / 'eval'}",
                 "data.num_classes=4", "optim.max_steps=20", *CHEAP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(tmp_path / "run")
    assert summary["steps"] == 20 and summary["eval_samples_counted"] == summary["eval_set_size"] == 64


def labelled(path: Path, labels: list[int], record_range: bool = True) -> Path:
    """A small dataset with these labels; ``record_range=False`` strips the manifest's value range,
    as a dataset written before Switchyard recorded it has none."""
    import numpy as np

    from sharding import DatasetWriter

    with DatasetWriter(path) as writer:
        for label in labels:
            writer.append({"x": np.ones((3, 16), np.float32), "y": np.int64(label)})
    if not record_range:
        manifest = json.loads((path / "manifest.json").read_text())
        for field in manifest["fields"]:
            field.pop("min_value", None)
            field.pop("max_value", None)
        (path / "manifest.json").write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize("record_range", [True, False])
def test_labels_beyond_num_classes_fail_before_submitting(tmp_path: Path, record_range: bool) -> None:
    """Before: accepted, then 'Target 3 is out of bounds' on every rank (after a queue wait on SLURM);
    as data.eval_path, only in the final evaluation, after all the training."""
    train_set = labelled(tmp_path / "train", [0, 1] * 64, record_range)
    eval_set = labelled(tmp_path / "eval", [0, 1, 2, 3] * 16, record_range)
    error = refused(tmp_path, f"data.path={train_set}", f"data.eval_path={eval_set}", "data.num_classes=2")
    assert error == (f"error: data.num_classes=2 is invalid: data.eval_path='{eval_set}' "
                     f"has labels 0..3 in 'y', so the model needs at least 4 classes "
                     f"(try data.num_classes=4)")
    negative = labelled(tmp_path / "negative", [-1, 0, 1] * 8, record_range)
    error = refused(tmp_path, f"data.path={negative}", "data.num_classes=2")
    assert "has labels -1..1 in 'y': class indices must be >= 0" in error


def test_the_writer_records_the_label_range(tmp_path: Path) -> None:
    from sharding import open_dataset

    path = labelled(tmp_path / "ds", [3, 7, 5])
    entry = next(f for f in json.loads((path / "manifest.json").read_text())["fields"] if f["name"] == "y")
    assert (entry["min_value"], entry["max_value"]) == (3, 7)
    assert open_dataset(path).value_range("y") == (3, 7)


def test_a_damaged_shard_met_while_scanning_labels_is_one_error(tmp_path: Path) -> None:
    """Before: a dataset without a recorded label range is scanned, and a shard whose index points
    past its data file raised CorruptDatasetError as a traceback from the pre-submission check."""
    import numpy as np

    path = labelled(tmp_path / "old", [0, 1] * 32, record_range=False)
    index = path / "shard-00000.idx"
    data = bytearray(index.read_bytes())
    header_and_table = index.stat().st_size - 8 * 64 * 3  # x offsets, y offsets, x lengths
    first_y_offset = header_and_table + 8 * 64
    data[first_y_offset:first_y_offset + 8] = np.int64(1 << 40).tobytes()
    index.write_bytes(bytes(data))
    error = refused(tmp_path, f"data.path={path}", "data.num_classes=2")  # any other error propagates
    assert error.startswith(f"error: data.path='{path}' cannot be read: shard 0 ({index}): "
                            f"field 'y' of local sample 0 lies outside the ")


FAILING_MODEL = '''
import time

from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """The built-in MLP, failing at its 8th forward pass (after the sampler has recorded some)."""

    calls = 0

    def forward(self, *args, **kwargs):
        Net.calls += 1
        if Net.calls == 8:
            raise RuntimeError("step 8 failed on purpose")
        time.sleep(0.05)
        return super().forward(*args, **kwargs)
'''


def test_a_failing_run_leaves_its_memory_summary_for_status(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 summarises the telemetry once as the run fails, so `switchyard status` of thousands
    of failed jobs reads one small file each instead of every job's samples; a rerun clears it."""
    from orchestrator.sweeps import results

    (tmp_path / "failing.py").write_text(FAILING_MODEL)
    paths = [str(tmp_path), os.environ.get("PYTHONPATH")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    proc = train(tmp_path, "model=custom", "model._target_=failing.Net", "telemetry.interval_s=0.05")
    assert proc.returncode != 0 and "step 8 failed on purpose" in proc.stdout + proc.stderr
    run_dir = tmp_path / "run"
    assert not (run_dir / "summary.json").exists()
    kept = json.loads((run_dir / "telemetry" / "end-summary.json").read_text())
    assert kept["mode"] == "cpu" and sorted(r["rank"] for r in kept["ranks"]) == [0, 1]

    def never(run: Path) -> None:
        raise AssertionError(f"summarised {run} again")

    monkeypatch.setattr(results, "summarize", never)
    assert results.job_memory(str(run_dir)) == kept
    rerun = train(tmp_path, "telemetry.interval_s=0.05", "optim.max_steps=2")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not (run_dir / "telemetry" / "end-summary.json").exists()


def test_a_missing_num_classes_proposes_the_count_the_labels_need(tmp_path: Path) -> None:
    """It proposed data.num_classes=10 whatever the labels were: 0..3 need 4."""
    path = labelled(tmp_path / "train", [0, 1, 2, 3] * 8)
    error = refused(tmp_path, f"data.path={path}")
    assert error == (f"error: data.num_classes is needed with data.path='{path}' (the model's output "
                     f"size; the dataset records no class list; its labels in 'y' go up to 3): try "
                     f"data.num_classes=4")
