"""The time-limit signal's lead time against the checkpoint saves measured in the run."""

from __future__ import annotations

from orchestrator.training.preemption import SIGNAL_MARGIN_S, lead_time_warning


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
