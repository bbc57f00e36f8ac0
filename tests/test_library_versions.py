"""The private hooks into submitit and Hydra are used only on the releases they were written for
(``orchestrator/library_versions.py``); outside them the plain path runs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import submitit

from orchestrator import entry, library_versions
from orchestrator.launch import job_entry, submit


@pytest.fixture
def fresh_answers() -> Iterator[None]:
    library_versions.outside.cache_clear()
    library_versions.hooks_allowed.cache_clear()
    yield
    library_versions.outside.cache_clear()
    library_versions.hooks_allowed.cache_clear()


@pytest.fixture
def future_releases(monkeypatch: pytest.MonkeyPatch, fresh_answers: None) -> None:
    monkeypatch.setattr(library_versions, "installed", lambda distribution: "99.0")


@pytest.mark.parametrize("distribution", sorted(library_versions.SUPPORTED))
def test_the_installed_release_is_one_the_hooks_were_written_for(distribution: str,
                                                                  fresh_answers: None) -> None:
    reason = library_versions.outside(distribution)
    assert reason is None, (
        f"{reason}. Read each hook that orchestrator/library_versions.py lists against this "
        f"release's source, then widen SUPPORTED[{distribution!r}] there")


def test_the_range_admits_its_lowest_release_and_not_the_next_minor() -> None:
    supported = library_versions.Supported("1.5", "1.6")
    assert supported.admits("1.5.0") and supported.admits("1.5.4")
    assert not supported.admits("1.6.0") and not supported.admits("1.4.9")
    assert not supported.admits("not a version")


def test_outside_its_releases_submitit_starts_its_own_way(future_releases: None, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    local = submit.new_executor("local", {}, tmp_path, rank_modules=["jobs.train"], own_code=True)
    slurm = submit.new_executor("slurm", {}, tmp_path, rank_modules=["jobs.train"], own_code=True)
    assert type(local) is submitit.LocalExecutor  # not the forking one, not job_entry's
    assert type(slurm) is submitit.SlurmExecutor and not isinstance(slurm, job_entry.EntryCommand)
    assert "submitit 99.0 is outside" in capsys.readouterr().err


def test_inside_its_releases_submitit_forks_the_ranks(fresh_answers: None, tmp_path: Path) -> None:
    from orchestrator.launch import fork_start
    local = submit.new_executor("local", {}, tmp_path, rank_modules=["jobs.train"], own_code=True)
    assert isinstance(local, fork_start.ForkingLocalExecutor)


def test_outside_its_releases_hydra_keeps_its_own_get_mode_and_loader(future_releases: None) -> None:
    from hydra._internal.hydra import Hydra
    from hydra.types import HydraContext

    from orchestrator.sweeps import points

    own = Hydra.get_mode
    with entry._mode_from_the_command_line():
        assert Hydra.get_mode is own
    context = HydraContext(config_loader=object(), callbacks=None)  # type: ignore[arg-type]
    points.install_composition_cache(context)
    assert not isinstance(context.config_loader, points.CompositionCache)
    assert entry._overrides(["prog", "a=1"]) == []  # Hydra refuses a bad override itself


def test_inside_its_releases_hydra_is_patched_only_while_the_app_runs(fresh_answers: None) -> None:
    from hydra._internal.hydra import Hydra

    own = Hydra.get_mode
    with entry._mode_from_the_command_line():
        assert Hydra.get_mode is not own
    assert Hydra.get_mode is own
    assert entry._overrides(["prog", "a=1"]) == ["a=1"]
