"""Hydra's mode probe (``orchestrator.entry.mode_probe_needed``): Hydra composes the whole config
once only to read ``hydra.mode``, then again to run. Switchyard's apps skip that first composition
where only their own configs take part, and keep it wherever another config could set the mode."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra._internal import utils as hydra_utils
from hydra._internal.hydra import Hydra
from hydra.types import RunMode

import jobs.train
from orchestrator import entry

CONF = Path(__file__).resolve().parents[1] / "conf"
MULTIRUN_BY_DEFAULT = "# @package _global_\nhydra:\n  mode: MULTIRUN\n"


def keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [k for key, value in node.items() for k in [f"{prefix}{key}", *keys(value, f"{prefix}{key}.")]]
    if isinstance(node, list):
        return [k for item in node for k in keys(item, prefix)]
    return []


def test_no_switchyard_config_sets_the_mode_or_the_search_path() -> None:
    """What skipping the probe relies on. The only ``mode`` is the cluster's (package ``cluster``)."""
    found = {}
    for path in sorted(CONF.rglob("*.yaml")):
        named = [k for k in keys(yaml.safe_load(path.read_text()) or {})
                 if k.rsplit(".", 1)[-1] in ("mode", "searchpath")]
        if named:
            found[str(path.relative_to(CONF))] = named
    assert found == {"cluster/debug.yaml": ["mode"], "cluster/local.yaml": ["mode"],
                     "cluster/slurm.yaml": ["mode"]}
    for name in found:
        assert "@package" not in (CONF / name).read_text()  # so at `cluster.mode`, not `hydra.mode`


@pytest.mark.parametrize(("search_path", "overrides", "needed"), [
    (entry.OWN_SEARCH_PATH, ["optim.lr=0.1", "+x=1", "model=transformer"], False),
    ({("hydra", "pkg://hydra.conf"), ("main", "pkg://conf")}, [], False),
    (entry.OWN_SEARCH_PATH | {("command-line", "file:///home/u/conf")}, [], True),  # --config-dir
    (entry.OWN_SEARCH_PATH | {("my-plugin", "pkg://theirs")}, [], True),  # a search path plugin
    ({("hydra", "pkg://hydra.conf"), ("main", "file:///app/conf")}, [], True),  # another app's configs
    (entry.OWN_SEARCH_PATH, ["hydra.mode=MULTIRUN"], True),
    (entry.OWN_SEARCH_PATH, ["++hydra.mode=RUN"], True),
    (entry.OWN_SEARCH_PATH, ["~hydra.mode"], True),
    (entry.OWN_SEARCH_PATH, ["hydra.searchpath=[file:///d]"], True),
    (entry.OWN_SEARCH_PATH, ["+hydra.searchpath=[pkg://x]"], True),
    (entry.OWN_SEARCH_PATH, ["hydra.job.chdir=false", "hydra/launcher=basic"], False),
])
def test_the_probe_is_needed_only_where_another_config_or_an_override_can_set_the_mode(
        search_path: set[tuple[str, str]], overrides: list[str], needed: bool) -> None:
    assert entry.mode_probe_needed(search_path, overrides) is needed


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``jobs.train``'s command line through ``hydra_app``, up to the mode Hydra runs it in: the
    overrides each probe composed with, and the mode ``_run_app`` got (None: the command line's)."""
    probed: list[list[str]] = []
    ran: list[RunMode | None] = []
    probe = Hydra.get_mode

    def counted(self: Hydra, config_name: str | None, overrides: list[str]) -> Any:
        probed.append(list(overrides))
        return probe(self, config_name, overrides)

    monkeypatch.setattr(Hydra, "get_mode", counted)
    monkeypatch.setattr(hydra_utils, "_run_app", lambda **kwargs: ran.append(kwargs["mode"]))

    def launch(*argv: str) -> tuple[list[list[str]], list[RunMode | None]]:
        monkeypatch.setattr(sys, "argv", ["jobs/train.py", *argv])
        entry.hydra_app(jobs.train.main, sys.argv)
        return probed, ran
    return launch


def test_a_run_or_a_sweep_of_switchyards_configs_composes_them_once(launched: Any) -> None:
    """Before: every ``jobs.train`` composed its config twice, the first time only for the probe."""
    assert launched("optim.max_steps=3", "model=transformer") == ([], [None])  # hydra_app answered
    assert launched("-m", "optim.lr=0.1,0.2")[0] == []


@pytest.mark.parametrize("how", ["--config-dir", "hydra.searchpath"])
def test_a_config_of_the_users_that_makes_sweeps_the_default_is_still_probed(
        launched: Any, tmp_path: Path, how: str) -> None:
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "sweeps.yaml").write_text(MULTIRUN_BY_DEFAULT)
    where = ["--config-dir", str(tmp_path)] if how == "--config-dir" else [f"hydra.searchpath=[file://{tmp_path}]"]
    probed, ran = launched(*where, "+extra=sweeps")
    assert len(probed) == 1 and ran == [RunMode.MULTIRUN]


def test_the_mode_given_as_an_override_is_probed(launched: Any) -> None:
    assert launched("hydra.mode=MULTIRUN") == ([["hydra.mode=MULTIRUN"]], [RunMode.MULTIRUN])


def test_a_hydra_whose_search_path_cannot_be_read_is_probed(
        launched: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe is Hydra's own (``hydra._internal``): where its loader no longer answers as 1.3's
    does, the probe runs as Hydra would run it, and the command is unchanged."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl

    monkeypatch.delattr(ConfigLoaderImpl, "get_search_path")
    probed, ran = launched("optim.max_steps=3")
    assert len(probed) == 1 and ran == [None]
