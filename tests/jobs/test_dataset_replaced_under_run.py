"""The issue's run: a dataset replaced while ``jobs.train`` reads it. ``jobs.prepare overwrite=true``
is refused, naming the run (rank 0 holds a lease on it); a replacement that goes around it (a copy
over the directory) stops the run at its next epoch, naming the path. It went on reading the new
shards and was reported COMPLETED."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rank_helpers import write_rows_dataset
from train_helpers import CHEAP, run_train

REPLACING_MODEL = '''
import os
import shutil
from pathlib import Path

import numpy as np
import torch

from jobs.models import RowPoolingMLP
from sharding import DatasetError, DatasetWriter


class Net(RowPoolingMLP):
    """At rank 0's second training step: tries jobs.prepare's overwrite, then swaps a new dataset
    of the same shapes and shard counts in by renames, as a copy over the directory would."""

    calls = 0

    def forward(self, x, mask):
        if self.training and torch.distributed.is_initialized() and torch.distributed.get_rank() == 0:
            Net.calls += 1
            if Net.calls == 2:
                replace(Path(os.environ["SWITCHYARD_TEST_DATA"]))
        return super().forward(x, mask)


def replace(data):
    note = data.parent / "overwrite.txt"
    try:
        write_rows(data, overwrite=True)
        note.write_text("published")
    except DatasetError as e:
        note.write_text(str(e))
    write_rows(data.parent / "new")
    data.rename(data.parent / "old")
    (data.parent / "new").rename(data)


def write_rows(path, overwrite=False):
    """tests/rank_helpers.write_rows_dataset's shapes and shard counts, other values."""
    rng = np.random.default_rng(1)
    with DatasetWriter(path, overwrite=overwrite) as writer:
        for i in range(32):
            writer.append({"x": rng.normal(size=(int(rng.integers(0, 5)), 5)).astype(np.float32),
                           "y": np.int64((i + 1) % 3)})
'''


def test_a_run_refuses_an_overwrite_of_its_dataset_and_stops_when_it_is_replaced_anyway(
        tmp_path: Path) -> None:
    data = Path(write_rows_dataset(tmp_path / "data", 32, features=5, classes=3, max_rows=4))
    (tmp_path / "replacing.py").write_text(REPLACING_MODEL)
    env = {"SWITCHYARD_TEST_DATA": str(data),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    # 32 samples, 2 ranks of 4: 4 steps an epoch, 12 in all
    proc = run_train("model=custom", "model._target_=replacing.Net", f"data.path={data}",
                     "data.num_classes=3", "data.batch_size=4", "optim.max_steps=12", *CHEAP,
                     run_dir=tmp_path / "run", cache_dir=tmp_path / "cache", env=env)
    refusal = (tmp_path / "overwrite.txt").read_text()
    assert refusal.startswith(f"{data} is being read by job ")
    assert f"run directory {tmp_path / 'run'}" in refusal
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert f"{data} was replaced while this run reads it" in proc.stdout + proc.stderr
    summary = tmp_path / "run" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text()).get("steps", 0) < 12
