"""Tasks for the tests, importable by ``task._target_`` (tests/ is on the path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from model_helpers import SlowDataOnRank1

from orchestrator.training.tasks.classify import Classify
from sharding import ShardedDataset
from sharding.loader import RankDataset


class SlowOnRank1Classify(Classify):
    """``task=classify`` whose training batches rank 1 reads late (``SlowDataOnRank1``); its
    evaluation reads as usual."""

    train_root: Path | None = None

    def setup(self, ds: ShardedDataset) -> None:
        super().setup(ds)
        self.train_root = ds.root

    def source(self, ds: ShardedDataset) -> Any:
        return SlowDataOnRank1(RankDataset(ds)) if ds.root == self.train_root else None
