"""The time-limit signal's lead time against the checkpoint saves measured: the warning at the
end of a run, and ``cluster.signal_delay_s=auto`` at the next submission."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from orchestrator.config import DEFAULT_SIGNAL_DELAY_S, ClusterConfig, ConfigError, register_configs
from orchestrator.launch.signal_delay import (
    SIGNAL_MARGIN_S,
    Choice,
    at_submission,
    choose,
    fitting_s,
    lead_time_warning,
    recorded,
)

register_configs()


def test_a_lead_time_below_twice_the_slowest_save_warns_naming_a_value_that_fits() -> None:
    warning = lead_time_warning(60, 40.2)
    assert warning is not None
    assert warning.startswith("cluster.signal_delay_s=60 may be too short: the slowest checkpoint "
                              "save took 40.2 s")
    assert warning.endswith(f"(try cluster.signal_delay_s={81 + SIGNAL_MARGIN_S})")


def test_enough_lead_time_or_no_save_is_quiet() -> None:
    assert lead_time_warning(120, 30.0) is None
    assert lead_time_warning(0, 0.0) is None  # nothing was saved: nothing measured
    assert lead_time_warning(2 * 5 + SIGNAL_MARGIN_S, 5.0) is None


def _cluster(**kw: object) -> ClusterConfig:
    return ClusterConfig(mode="slurm", **kw)  # type: ignore[arg-type]


def test_auto_takes_the_slowest_save_of_the_last_run_in_the_same_directory(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_slowest_save_s": 42.3}))
    choice = choose(_cluster(signal_delay_s="auto"), tmp_path)
    assert choice.seconds == fitting_s(42.3) == 85 + SIGNAL_MARGIN_S
    assert choice.source.startswith("auto: 2 x 42.3 s, the slowest checkpoint save of the last run")


@pytest.mark.parametrize("summary", [None, "{not json", json.dumps({"checkpoint_slowest_save_s": 0.0}),
                                     json.dumps({"steps": 3})])
def test_auto_with_no_measured_save_takes_the_default_and_says_so(tmp_path: Path,
                                                                  summary: str | None) -> None:
    if summary is not None:
        (tmp_path / "summary.json").write_text(summary)
    choice = choose(_cluster(signal_delay_s="auto"), tmp_path)
    assert choice.seconds == DEFAULT_SIGNAL_DELAY_S
    assert "no checkpoint save measured by a previous run" in choice.source
    assert choice.source.endswith("so the default")


def test_a_number_is_taken_as_given_even_with_figures(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_slowest_save_s": 300.0}))
    assert choose(_cluster(signal_delay_s=45), tmp_path) == Choice(45, "cluster.signal_delay_s=45")


def test_auto_that_would_not_fit_below_the_time_limit_is_refused(tmp_path: Path) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_slowest_save_s": 40.0}))
    with pytest.raises(ConfigError, match=r"cluster.signal_delay_s='auto' is invalid here: .* saved a "
                                          r"checkpoint in 40.0 s, so the signal would need 90 s .* the "
                                          r"limit is 60 s \(try cluster.timeout_min=3"):
        choose(_cluster(signal_delay_s="auto", timeout_min=1), tmp_path)


def test_at_submission_gives_sbatch_a_number_and_records_the_choice(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "summary.json").write_text(json.dumps({"checkpoint_slowest_save_s": 5.0}))
    cluster = at_submission(_cluster(signal_delay_s="auto"), tmp_path)
    assert cluster.signal_delay_s == 20
    assert capsys.readouterr().out.startswith("signal_delay_s: 20 (auto: 2 x 5.0 s")
    assert recorded(tmp_path) == {"seconds": 20, "source": choose(_cluster(signal_delay_s="auto"),
                                                                  tmp_path).source}


@pytest.mark.parametrize("value", ["Auto", "2m", ""])
def test_a_word_other_than_auto_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=rf"cluster.signal_delay_s='{value}' is invalid: a number of "
                                          r"seconds, or auto .*\(try cluster.signal_delay_s=auto"):
        ClusterConfig(signal_delay_s=value)


def test_auto_composes_from_the_command_line_and_a_fraction_does_not() -> None:
    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["cluster=slurm", "cluster.signal_delay_s=auto"])
        assert OmegaConf.to_object(cfg.cluster).signal_delay_s == "auto"  # type: ignore[union-attr]
        with pytest.raises(ConfigCompositionException, match=r"cluster.signal_delay_s=90.5"):
            compose(config_name="train", overrides=["cluster=slurm", "cluster.signal_delay_s=90.5"])


def proposals(message: str) -> list[dict[str, int]]:
    """The ``(try key=N, or key=M)`` of a refusal, as ClusterConfig keyword arguments."""
    fix = message.rsplit("(try ", 1)[1].rstrip(")")
    return [{key.removeprefix("cluster."): int(value)}
            for key, value in (part.split("=") for part in fix.split(", or "))]


@pytest.mark.parametrize(("timeout_min", "seconds"), [(1, 120), (1, 60), (2, 600), (60, -5), (3, 10**20)])
def test_a_lead_time_outside_the_limit_proposes_values_that_pass(timeout_min: int, seconds: int) -> None:
    """Issue 34: with timeout_min=1 the refusal of 120 proposed cluster.signal_delay_s=120."""
    with pytest.raises(ConfigError) as refused:
        ClusterConfig(timeout_min=timeout_min, signal_delay_s=seconds)
    assert str(refused.value).startswith(f"cluster.signal_delay_s={seconds} is invalid: must be "
                                         f"between 0 and the time limit ({timeout_min * 60} s)")
    for fix in proposals(str(refused.value)):
        assert ClusterConfig(**{"timeout_min": timeout_min, "signal_delay_s": seconds, **fix})


def test_auto_whose_default_does_not_fit_is_refused_as_auto(tmp_path: Path) -> None:
    """Issue 34: the refusal began cluster.signal_delay_s=120, a value the user never typed."""
    with pytest.raises(ConfigError) as refused:
        at_submission(_cluster(signal_delay_s="auto", timeout_min=1), tmp_path)
    assert str(refused.value) == (
        f"cluster.signal_delay_s='auto' is invalid here: no previous run in {tmp_path} measured a "
        f"checkpoint save, so auto takes the default 120 s, and the time limit is 60 s (try "
        f"cluster.signal_delay_s=30, or cluster.timeout_min=3)")
    for fix in proposals(str(refused.value)):
        at_submission(_cluster(**{"signal_delay_s": "auto", "timeout_min": 1, **fix}), tmp_path)
