"""ShardedDataModule under Lightning's own DDP on CPU (gloo), 2 local ranks through `switchyard run`:
every eval sample counted once, an interrupted epoch resumed exactly (same or other world size),
and a Trainer that would replace the sampler refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from lightning_helpers import (
    EVAL_SAMPLES,
    TRAIN_SAMPLES,
    eval_counts,
    recipe_command,
    seen,
    uninterrupted,
    write_data,
)

from sharding import DatasetWriter, open_dataset
from sharding.lightning import REFUSAL, LightningSetupError, sample_sums

# Lightning itself is imported by the tests that fit in this process (lightning_modules), not here
pytestmark = pytest.mark.skipif(find_spec("lightning") is None, reason="needs lightning")


def run(tmp_path: Path, run_dir: str, record: Path, *args: str, overrides: tuple[str, ...] = ()
        ) -> subprocess.CompletedProcess[str]:
    train, eval_ = tmp_path / "train", tmp_path / "eval"
    record.mkdir(exist_ok=True)
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "run", "telemetry.enabled=false", *overrides,
         f"hydra.run.dir={tmp_path / run_dir}", "--", *recipe_command(train, eval_, record, *args)],
        cwd=tmp_path, env={**os.environ, "SWITCHYARD_REGISTRY": str(tmp_path / "registry.db")},
        capture_output=True, text=True, timeout=400)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    write_data(tmp_path)
    return tmp_path


def test_an_interrupted_epoch_resumes_exactly_at_the_same_world_size_and_at_another(data: Path) -> None:
    """One cut, resumed twice: in its own run directory at world 2, and from a copy of its
    checkpoint at world 1 (a cut costs two recipe ranks, about 5 s of CPU each)."""
    # 12 batches per rank per epoch: SIGUSR2 after 17 lands mid-epoch 1 (the helper's real handler)
    first = run(data, "cut", data / "cut", "--stop-after", "17")
    assert first.returncode != 0 and "asked to be requeued (exit 75)" in first.stdout + first.stderr
    assert (data / "cut" / "checkpoints" / "last.ckpt").exists()
    shutil.copytree(data / "cut" / "checkpoints", data / "other" / "checkpoints")
    shutil.copytree(data / "cut" / ".switchyard", data / "other" / ".switchyard")  # a run's own directory
    for record in (data / "cut").glob("*-rank*.jsonl"):  # what each rank trained and evaluated on
        shutil.copy(record, data / "other" / record.name)

    again = run(data, "cut", data / "cut", "--stop-after", "17")  # the same run dir: resumes
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    # an uninterrupted run's batches, from the data module's sampler and loader (a whole second
    # run of the recipe trained on exactly these when it ran here; uninterrupted() says why not)
    expected = uninterrupted(data / "train", world=2, epochs=2)
    for rank in (0, 1):
        assert seen(data / "cut", rank) == expected[rank]  # same samples, same order
        assert eval_counts(data / "cut", rank) == [EVAL_SAMPLES] * 2  # sync_dist sums: each once
    for epoch in (0, 1):  # each rank reads its own half: together every sample once per epoch
        per_rank = [[i for e, batch in seen(data / "cut", r) if e == epoch for i in batch] for r in (0, 1)]
        assert len(per_rank[0]) == len(per_rank[1]) == TRAIN_SAMPLES // 2
        assert sorted(per_rank[0] + per_rank[1]) == list(range(TRAIN_SAMPLES))

    # at world 1: the resumed epoch (its batches done at world 2 + those left at world 1), then a
    # whole one at the new world size. Lightning takes the loader's length once, and the resumed
    # epoch's length once cut every later epoch short.
    other = run(data, "other", data / "other", "--epochs", "3", overrides=("parallelism.procs_per_node=1",))
    assert other.returncode == 0, other.stdout + other.stderr[-3000:]
    assert "world 1 via" in other.stdout + "".join(
        p.read_text() for p in (data / "other" / "submitit").glob("*_log.out"))
    for epoch in (0, 1, 2):
        counts = Counter(i for rank in (0, 1) for e, batch in seen(data / "other", rank) if e == epoch
                         for i in batch)
        assert sorted(counts) == list(range(TRAIN_SAMPLES)) and set(counts.values()) == {1}, epoch
    # the resumed epoch validates too (epoch 0's line is the cut's, at world 2): its batch count
    # stopped short of the length Lightning took, so its end-of-epoch validation never ran
    assert eval_counts(data / "other", 0) == [EVAL_SAMPLES] * 3
    # Lightning sees the loader resume (its state_dict/load_state_dict): no "not resumable" warning
    logs = "".join(p.read_text() for run_dir in ("cut", "other")
                   for p in (data / run_dir / "submitit").glob("*_log.*"))
    assert "resumed from" in logs or "Restoring states from the checkpoint" in logs
    assert "not resumable" not in logs


def test_sample_sums_leave_padding_entries_out() -> None:
    total, count = sample_sums(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([False, True, False]))
    assert (total.item(), count.item()) == (5.0, 2.0)
    with pytest.raises(ValueError, match=r"values has shape \(3, 2\) but is_pad has \(3,\)"):
        sample_sums(torch.zeros(3, 2), torch.zeros(3, dtype=torch.bool))


def test_a_trainer_that_would_replace_the_sampler_is_refused_in_one_line(data: Path) -> None:
    from lightning_modules import Tiny, trainer

    from sharding.lightning import ShardedDataModule

    dm = ShardedDataModule(train=data / "train", batch_size=4)
    with pytest.raises(LightningSetupError) as refused:
        trainer(max_steps=1).fit(Tiny(), datamodule=dm)  # use_distributed_sampler: True by default
    assert str(refused.value) == REFUSAL and "\n" not in REFUSAL
    assert "Trainer(use_distributed_sampler=False)" in REFUSAL


STANDALONE = """
import sys
import pytorch_lightning as pl
import torch
from sharding.lightning import ShardedDataModule

assert issubclass(ShardedDataModule, pl.LightningDataModule) and "lightning.pytorch" not in sys.modules


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def training_step(self, batch, batch_idx):
        return self.linear(batch["x"].sum(1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


dm = ShardedDataModule(train=sys.argv[1], batch_size=4)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, use_distributed_sampler=False,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Tiny(), datamodule=dm)
print("segments", dm.state_dict()["sampler"]["segments"])
"""


def test_the_standalone_pytorch_lightning_package_works_too(data: Path) -> None:
    pytest.importorskip("pytorch_lightning")
    proc = subprocess.run([sys.executable, "-c", STANDALONE, str(data / "train")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "segments [[1, 12]]" in proc.stdout  # 3 batches of 4 advanced the sampler


def test_a_length_grouped_epoch_resumes_at_the_next_batch_in_process(data: Path) -> None:
    """Exactly, and without Lightning's warning that the loader is "not resumable ... unreliable
    results", which every mid-epoch resume printed: Lightning now sees the loader's state."""
    from lightning_modules import Recorder, fit

    whole = Recorder(save_at=17, path=data / "mid.ckpt")  # 12 batches an epoch: epoch 1, batch 5
    fit(data, whole)
    resumed = Recorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(data, resumed, ckpt=data / "mid.ckpt")
    assert len(whole.batches) == 24 and resumed.batches == whole.batches[17:]
    assert not [w for w in caught if "not resumable" in str(w.message)]


def test_a_resume_on_another_dataset_with_the_same_shard_counts_is_refused(data: Path) -> None:
    """Its position would mean other samples there: it went on silently, as the sampler checks
    only the shard counts. The dataset's fingerprint is in the checkpoint now."""
    from lightning_modules import Recorder, Tiny, trainer

    from sharding.lightning import ShardedDataModule

    save = Recorder(save_at=5, path=data / "mid.ckpt")
    trainer(max_epochs=1, use_distributed_sampler=False, callbacks=[save]).fit(
        Tiny(), datamodule=ShardedDataModule(train=data / "train", batch_size=8))
    shutil.copytree(data / "train", data / "again")
    changed = data / "relabelled"  # the same samples' sizes, so the same shard counts; other labels
    with DatasetWriter(changed, shard_bytes=2048) as writer:
        for sample in map(open_dataset(data / "train").sample, range(TRAIN_SAMPLES)):
            writer.append({"x": sample["x"], "y": (sample["y"] + 1) % 4})
    assert open_dataset(changed).shard_counts == open_dataset(data / "train").shard_counts
    with pytest.raises(LightningSetupError) as refused:
        trainer(max_epochs=1, use_distributed_sampler=False).fit(
            Tiny(), datamodule=ShardedDataModule(train=changed, batch_size=8), ckpt_path=data / "mid.ckpt")
    assert f"ShardedDataModule(train={str(changed)!r}) is dataset" in str(refused.value)
    assert "resume with the dataset it was trained on" in str(refused.value)
    # the same dataset elsewhere (a copy) resumes: its fingerprint is its content, not its path
    trainer(max_epochs=1, use_distributed_sampler=False).fit(
        Tiny(), datamodule=ShardedDataModule(train=data / "again", batch_size=8), ckpt_path=data / "mid.ckpt")


def test_a_data_module_reused_by_a_second_trainer_still_counts_its_batches(data: Path) -> None:
    """The callback that advances the sampler was attached to the first Trainer only: a second
    Trainer's batches went uncounted, so its checkpoints held the first one's position and a resume
    from them trained those batches again."""
    from lightning_modules import Tiny, trainer

    from sharding.lightning import ShardedDataModule

    dm = ShardedDataModule(train=data / "train", batch_size=4)
    for steps in (3, 5):
        trainer(max_steps=steps, use_distributed_sampler=False).fit(Tiny(), datamodule=dm)
        state = dm.state_dict()  # each new fit starts the data from the epoch's start, as the model's
        assert state["batches_done"] == steps and state["sampler"]["segments"] == [[1, 4 * steps]]


def test_a_fitting_module_holds_its_datasets_so_an_overwrite_is_refused(data: Path) -> None:
    """jobs.prepare overwrite=true of the data a Lightning run reads went ahead; rank 0 holds a
    lease on each of its datasets from setup to teardown now (sharding.lease)."""
    from lightning_modules import AtTrainStart, Tiny, trainer

    from sharding import DatasetError
    from sharding.lease import readers_dir
    from sharding.lightning import ShardedDataModule
    from sharding.writer import check_output

    refusals: list[str] = []

    def try_overwrite() -> None:
        for path in (data / "train", data / "eval"):
            with pytest.raises(DatasetError) as refused:
                check_output(path, overwrite=True)
            refusals.append(str(refused.value))

    dm = ShardedDataModule(train=data / "train", eval=data / "eval", batch_size=4)
    trainer(max_steps=2, use_distributed_sampler=False, callbacks=[AtTrainStart(try_overwrite)]).fit(
        Tiny(), datamodule=dm)
    assert len(refusals) == 2
    assert all(" is being read by a Lightning run (rank 0, pid " in refusal for refusal in refusals)
    assert not readers_dir(data / "train").exists() and not readers_dir(data / "eval").exists()
    check_output(data / "train", overwrite=True)  # the fit ended: nothing holds it
