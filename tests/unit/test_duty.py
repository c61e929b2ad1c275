"""The overhead budget's arithmetic: time on between two readings of a
runtime's duty-cycle words, and the duty cycle a budget allows."""

from __future__ import annotations

import pytest
from tramprof.unwind.descriptor import DutyState
from tramprof.unwind.duty import MIN_DUTY, duty_for, on_share


def state(off_ns: int, paused_since_ns: int = 0) -> DutyState:
    return DutyState(duty_ppm=500_000, paused=paused_since_ns != 0, hook_calls=0,
                     off_ns=off_ns, paused_since_ns=paused_since_ns, call_cost_ps=10_000)


def test_on_share_counts_closed_and_open_pauses() -> None:
    # 10 s between readings: 3 s of pauses closed meanwhile, and a pause
    # open since 1 s before the second reading.
    before, after = state(2_000_000_000), state(5_000_000_000, paused_since_ns=109 * 10**9)
    assert on_share(before, after, 100.0, 110.0) == pytest.approx(0.6)


def test_on_share_with_a_pause_open_at_both_readings() -> None:
    # Paused since 95 s: the whole interval 100..110 s was off.
    before = state(1_000_000_000, paused_since_ns=95 * 10**9)
    after = state(1_000_000_000, paused_since_ns=95 * 10**9)
    assert on_share(before, after, 100.0, 110.0) == 0.0


def test_on_share_is_bounded() -> None:
    assert on_share(state(0), state(0), 100.0, 100.0) == 0.0        # no time passed
    assert on_share(state(5), state(0), 100.0, 101.0) == 1.0        # counters went back


@pytest.mark.parametrize(("budget", "overhead", "duty"), [
    (0.05, 0.25, 0.2), (0.05, 0.04, 1.0), (0.25, 0.25, 1.0), (0.01, 0.9, 0.011111111),
    (0.001, 0.5, MIN_DUTY),
])
def test_duty_for_budget(budget: float, overhead: float, duty: float) -> None:
    assert duty_for(budget, overhead) == pytest.approx(duty)
