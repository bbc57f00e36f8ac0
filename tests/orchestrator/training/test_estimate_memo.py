"""Memory estimates remembered across submissions (``memory.estimate_cache``): the same step is read
back instead of run again, and anything the step's memory depends on (config, data, code) makes it
run again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import cast

import pytest
import torch.distributed as dist
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from jobs import train
from orchestrator.config import TrainConfig
from orchestrator.training import checks, estimate, estimate_memo
from orchestrator.training.tasks import build_task
from sharding import open_dataset

SMALL = ["data.batch_size=8", "data.demo_num_samples=64"]
SMALL_MLP = ["model=mlp", "model.hidden_dim=16"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("datasets")


def config(data: Path, remembered: Path | None, *overrides: str) -> TrainConfig:
    """A small MLP unless ``overrides`` name another model."""
    model = [] if any(o.startswith("model=") for o in overrides) else SMALL_MLP
    with initialize_config_module("conf", version_base="1.3"):
        composed = compose("train", overrides=[*model, *SMALL, f"data.cache_dir={data}",
                                               f"memory.estimate_cache={remembered or 'null'}", *overrides])
    return cast(TrainConfig, OmegaConf.to_object(composed))


def memory_check(cfg: TrainConfig, fresh_process: bool = True) -> estimate.MemoryReport:
    """``check_memory`` as a new submitting process runs it: nothing remembered in this process."""
    if fresh_process:
        estimate._ESTIMATES.clear()
    ds = open_dataset(train.data_paths(cfg, generate=True).train)
    task = build_task(cfg.task, cfg.data)
    task.setup(ds)
    report = estimate.check_memory(cfg, task, ds, checks.example_batch(task, ds))
    assert report is not None
    return report


def not_run(*args: object) -> estimate.Estimate:
    raise AssertionError("the estimate ran: it should have been read back")


def test_a_second_submission_reads_the_estimate_back(data: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    first = memory_check(config(data, tmp_path))
    assert not first.remembered and first.estimate is not None and first.line().endswith("(estimate)")
    assert len(list(tmp_path.glob("*.json"))) == 1
    monkeypatch.setattr(estimate, "run_estimate", not_run)
    again = memory_check(config(data, tmp_path, "optim.lr=0.5", "seed=7", "optim.max_steps=3"))
    assert again.remembered and again.estimate == first.estimate
    assert again.line().endswith("(estimate, remembered)") and again.as_dict()["remembered"] is True


def test_what_the_step_depends_on_runs_it_again(data: Path, tmp_path: Path) -> None:
    base = memory_check(config(data, tmp_path))
    for change in ("data.batch_size=4", "memory.amp=bf16", "optim=sgd", "parallelism.procs_per_node=3"):
        found = memory_check(config(data, tmp_path, change))
        assert not found.remembered, change
    assert memory_check(config(data, tmp_path)).remembered
    assert len(list(tmp_path.glob("*.json"))) == 5
    assert base.estimate is not None


def test_the_same_data_elsewhere_is_the_same_step(data: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The data is its fingerprint, not its place: the demo data generated into another cache."""
    first = memory_check(config(data, tmp_path / "memo"))
    monkeypatch.setattr(estimate, "run_estimate", not_run)
    moved = memory_check(config(data, tmp_path / "memo", f"data.cache_dir={tmp_path / 'elsewhere'}"))
    assert (tmp_path / "elsewhere").is_dir() and moved.remembered and moved.estimate == first.estimate


MODEL = '''
from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """WIDTH extra features: an edit of this file changes the step's memory."""

    def __init__(self, **kwargs):
        kwargs["hidden_dim"] = WIDTH
        super().__init__(**kwargs)
'''


def test_an_edit_of_the_models_code_runs_it_again(data: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's file joins the key by its size and modification time: the edited model's estimate
    is its own, not the one remembered for the file before the edit."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "edited_model.py").write_text(MODEL.replace("WIDTH", "16"))
    monkeypatch.syspath_prepend(str(code))
    model = ["model=custom", "model._target_=edited_model.Net"]
    narrow = memory_check(config(data, tmp_path / "memo", *model))
    assert memory_check(config(data, tmp_path / "memo", *model)).remembered
    (code / "edited_model.py").write_text(MODEL.replace("WIDTH", "512"))
    sys.modules.pop("edited_model")  # a new submitting process imports the edited file
    wide = memory_check(config(data, tmp_path / "memo", *model))
    assert not wide.remembered
    assert wide.estimate is not None and narrow.estimate is not None
    assert wide.estimate.parameters > narrow.estimate.parameters


def test_a_damaged_or_foreign_file_is_a_miss_and_is_replaced(data: Path, tmp_path: Path) -> None:
    first = memory_check(config(data, tmp_path))
    (written,) = tmp_path.glob("*.json")
    for damaged in ('{"format": 1, "estimate": {"peak": 1}}', "{not json", '{"format": 99, "estimate": {}}',
                    "[1, 2]"):
        written.write_text(damaged)
        found = memory_check(config(data, tmp_path))
        assert not found.remembered and found.estimate == first.estimate, damaged
        assert json.loads(written.read_text())["estimate"] == first.estimate.as_dict()  # type: ignore[union-attr]


def test_an_unwritable_folder_loses_only_the_memory(data: Path, tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    cfg = config(data, blocked / "memo")
    assert memory_check(cfg).estimate is not None and not memory_check(cfg).remembered


def test_null_remembers_nothing(data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert not memory_check(config(data, None)).remembered
    assert not memory_check(config(data, None)).remembered
    assert not list(tmp_path.rglob("*.json"))


HOST_READING_MODEL = '''
from jobs.models import RowPoolingMLP


class Net(RowPoolingMLP):
    """Reads a value on the host each step: no fake tensor can answer that."""

    def forward(self, x, mask):
        out = super().forward(x, mask)
        return out * 0 if float(out.detach().abs().max()) > 1e9 else out
'''


def test_a_step_that_cannot_be_estimated_is_remembered_so(data: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "host_reads.py").write_text(HOST_READING_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = ["model=custom", "model._target_=host_reads.Net"]
    first = memory_check(config(data, tmp_path / "memo", *model))
    assert first.estimate is None and "does not run on fake tensors" in str(first.unavailable)
    monkeypatch.setattr(estimate, "run_estimate", not_run)
    again = memory_check(config(data, tmp_path / "memo", *model))
    assert again.estimate is None and again.unavailable == first.unavailable


def test_a_process_group_running_here_is_not_remembered_as_the_steps(data: Path, tmp_path: Path) -> None:
    fsdp = ["parallelism.strategy=fsdp", "parallelism.procs_per_node=2"]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        inside = memory_check(config(data, tmp_path, *fsdp))
    finally:
        dist.destroy_process_group()
    assert inside.estimate is None and str(inside.unavailable).startswith("a process group already runs here")
    assert not list(tmp_path.glob("*.json"))
    assert memory_check(config(data, tmp_path, *fsdp), fresh_process=False).estimate is not None


def test_the_folder_keeps_its_newest_files_and_never_deletes_anything_else(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``memory.estimate_cache`` may name a folder that holds the user's own files: older than
    every estimate, and some named almost as ours, they are all kept."""
    monkeypatch.setattr(estimate_memo, "KEEP", 3)
    names = [estimate_memo.file_name(f"step {i}") for i in range(6)]
    foreign = ["results.json", "estimate-notours.json", f"x{names[0]}", names[0].upper()]
    for name in foreign:
        (tmp_path / name).write_text("{}")
        os.utime(tmp_path / name, (1, 1))
    for i, name in enumerate(names[:5]):
        estimate_memo.remember(tmp_path, name, f"step {i}", {"unavailable": str(i)})
        os.utime(tmp_path / name, (1000 + i, 1000 + i))
    estimate_memo.remember(tmp_path, names[5], "step 5", {"unavailable": "5"})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*foreign, *names[3:]])


RECALL = textwrap.dedent('''
    import sys
    from hydra import compose, initialize_config_module
    from jobs.train import check_before_submit, load_config
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = load_config(compose(config_name="train", overrides=sys.argv[1:]))
    _, report = check_before_submit(cfg)
    print(report.remembered, "torch._dynamo" in sys.modules)
''')


def test_a_remembered_estimate_spares_the_submitting_process_the_compiler_stack(
        data: Path, tmp_path: Path) -> None:
    """What remembering is for: the fake-tensor step imports ``torch._dynamo`` (1.5-2 s of a
    submission's CPU); the second submitting process imports none of it."""
    overrides = [*SMALL_MLP, *SMALL, f"data.cache_dir={data}", f"memory.estimate_cache={tmp_path}"]
    seen = [subprocess.run([sys.executable, "-c", RECALL, *overrides], capture_output=True, text=True,
                           timeout=300, check=True).stdout.split() for _ in range(2)]
    assert seen == [["False", "True"], ["True", "False"]]
