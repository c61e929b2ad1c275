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


def own_cpu_seconds() -> float:
    return duty.read_stat(os.getpid()).cpu_ticks / duty.CLOCK_TICKS


def test_a_runtime_never_paused_gets_its_duty_cycle_when_found() -> None:
    """Its counters cover the process's whole life with the hook on: the
    first update writes a duty cycle from them, without waiting for a
    second reading; the first interval measured replaces that estimate."""
    now = [100.0]
    words = ctypes.create_string_buffer(struct.pack("<I", DUTY_ALWAYS), 8)
    cycle = DutyCycle(budget=0.05, clock=lambda: now[0])
    pid = os.getpid()
    assert cycle.track(pid, ctypes.addressof(words) - DUTY_PPM_OFFSET)
    assert not cycle.track(pid, ctypes.addressof(words) - DUTY_PPM_OFFSET)
    cost_ps = 10_000  # 10 ns a call
    cpu = own_cpu_seconds()
    assert cpu >= duty.MIN_ON_SECONDS
    # Calls enough for half of the CPU so far: duty 0.05 / 0.5.
    born = replace(state(0), duty_ppm=DUTY_ALWAYS, call_cost_ps=cost_ps,
                   hook_calls=round(0.5 * cpu / (cost_ps * 1e-12)))
    cycle.update(pid, born)
    proc = cycle.get(pid)
    assert proc is not None and proc.provisional
    assert proc.overhead_on == pytest.approx(0.5, rel=0.05)
    assert struct.unpack_from("<I", words.raw)[0] == pytest.approx(100_000, rel=0.05)

    # One second later, on all of it, with calls for a fifth of the CPU
    # spent meanwhile: the estimate becomes that, not a blend with 0.5.
    burn_until = own_cpu_seconds() + 0.2
    while own_cpu_seconds() < burn_until:
        pass
    spent = own_cpu_seconds() - proc.last_cpu
    now[0] = 101.0
    later = replace(born, duty_ppm=100_000,
                    hook_calls=born.hook_calls + round(0.2 * spent / (cost_ps * 1e-12)))
    cycle.update(pid, later)
    assert not proc.provisional
    assert proc.overhead_on == pytest.approx(0.2, rel=0.15)


def test_a_runtime_paused_before_has_no_lifetime_estimate() -> None:
    """Its counters no longer say how long the hook was on: the first
    update only takes a reading, and nothing is written."""
    words = ctypes.create_string_buffer(struct.pack("<I", 300_000), 8)
    cycle = DutyCycle(budget=0.05)
    cycle.track(os.getpid(), ctypes.addressof(words) - DUTY_PPM_OFFSET)
    cycle.update(os.getpid(), replace(state(5_000_000_000), duty_ppm=300_000,
                                      hook_calls=10**9))
    proc = cycle.get(os.getpid())
    assert proc is not None and proc.overhead_on is None and proc.last is not None
    assert struct.unpack_from("<I", words.raw)[0] == 300_000
