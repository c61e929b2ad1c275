"""The overhead budget's arithmetic: time on between two readings of a
runtime's duty-cycle words, and the duty cycle a budget allows."""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
from dataclasses import replace

import pytest
from tramprof.unwind import duty
from tramprof.unwind.descriptor import DUTY_ALWAYS, DUTY_PPM_OFFSET, DutyState
from tramprof.unwind.duty import MIN_DUTY, DutyCycle, duty_for, on_share


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


def test_without_a_budget_a_process_is_measured_every_unbudgeted_seconds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its estimate is only exported: one stat read per process every 10 s,
    not at every refresh; a duty cycle set by someone else is still undone
    at the next refresh."""
    now = [100.0]
    reads: list[float] = []
    real_read_stat = duty.read_stat

    def counted(pid: int, proc_root: str = "/proc") -> object:
        reads.append(now[0])
        return real_read_stat(pid, proc_root)

    monkeypatch.setattr(duty, "read_stat", counted)
    words = ctypes.create_string_buffer(struct.pack("<I", DUTY_ALWAYS), 8)
    cycle = DutyCycle(budget=0.0, clock=lambda: now[0])
    cycle.track(os.getpid(), ctypes.addressof(words) - DUTY_PPM_OFFSET)
    always = replace(state(0), duty_ppm=DUTY_ALWAYS)
    for second in range(100, 125):
        now[0] = float(second)
        cycle.update(os.getpid(), always)
    assert reads == [100.0, 110.0, 120.0]

    words.raw = struct.pack("<I", 500_000) + bytes(4)  # another daemon's budget
    now[0] = 125.0
    cycle.update(os.getpid(), replace(always, duty_ppm=500_000))
    assert reads[-1] == 125.0
    assert struct.unpack_from("<I", words.raw)[0] == DUTY_ALWAYS


def test_a_refused_write_is_counted_and_logged_once_at_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """The process runs but takes no write (here: the descriptor's address
    is not mapped, EFAULT): counted at every attempt, so the metric shows a
    budget that never takes effect; a warning the first time, debug after."""
    cycle = DutyCycle(budget=0.0)
    cycle.track(os.getpid(), 0x10 - DUTY_PPM_OFFSET)  # page 0: never mapped
    caplog.set_level("DEBUG", logger=duty.__name__)
    set_by_another = replace(state(0), duty_ppm=500_000)
    for _ in range(3):
        cycle.update(os.getpid(), set_by_another)
    assert cycle.writes_failed == 3
    refusals = [r for r in caplog.records if "cannot set its duty cycle" in r.getMessage()]
    assert [r.levelname for r in refusals] == ["WARNING", "DEBUG", "DEBUG"]
    assert "Bad address" in refusals[0].getMessage()


def test_a_process_gone_before_the_write_is_not_a_refusal(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """It exits between the read of its CPU time and the write (ESRCH from
    process_vm_writev): nothing to count, nothing to warn about."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: its pid names no process now
    real_read_stat = duty.read_stat
    monkeypatch.setattr(duty, "read_stat",
                        lambda pid, proc_root="/proc": real_read_stat(os.getpid(), proc_root))
    cycle = DutyCycle(budget=0.0)
    cycle.track(child.pid, 0x10000)
    caplog.set_level("DEBUG", logger=duty.__name__)
    cycle.update(child.pid, replace(state(0), duty_ppm=500_000))
    assert cycle.writes_failed == 0
    assert not [r for r in caplog.records if "cannot set its duty cycle" in r.getMessage()]
