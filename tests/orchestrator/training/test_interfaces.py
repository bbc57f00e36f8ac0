"""The interfaces a variant implements (``Task``, the checkpoint format ``Checkpointer``) are abstract
base classes: a variant that lacks a method fails when it is built, not at its first call on the
ranks. A user's task (``task._target_=pkg.MyTask``) missing one is refused before submission,
naming what it lacks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, DataConfig
from orchestrator.training import checkpointing
from orchestrator.training.tasks import Task, build_task

NO_FORWARD = '''
from orchestrator.training.tasks import Task


class NoForward(Task):
    def loss_sums(self, output, batch):
        return output.sum(), output.new_ones(()).sum()
'''


def test_a_users_task_without_forward_is_refused_when_built_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "usertasks.py").write_text(NO_FORWARD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "usertasks", raising=False)
    with pytest.raises(ConfigError, match=r"task._target_='usertasks.NoForward' does not define forward "
                                          r"\(a Task subclass defines forward\(model, batch\)"):
        build_task({"_target_": "usertasks.NoForward"}, DataConfig())
    with pytest.raises(TypeError, match="forward"):  # in Python too: when built, not when first called
        sys.modules["usertasks"].NoForward(DataConfig())


def test_every_built_in_task_is_complete() -> None:
    for name in ("classify.Classify", "regress.Regress", "causal_lm.CausalLm"):
        assert isinstance(build_task({"_target_": f"orchestrator.training.tasks.{name}"}, DataConfig()), Task)


def test_a_checkpoint_format_without_load_fails_when_built() -> None:
    class NoLoad(checkpointing.Checkpointer):
        def save(self, *args: object, **kwargs: object) -> None: ...

        def _find(self, listed: list[Path]) -> None: ...

    with pytest.raises(TypeError, match="load"):
        NoLoad(None, None, Path("."))  # type: ignore[arg-type]  # never reaches the attributes
    assert not checkpointing.SingleFile.__abstractmethods__ and not checkpointing.Sharded.__abstractmethods__
