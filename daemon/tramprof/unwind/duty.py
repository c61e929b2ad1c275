"""Python overhead budget: duty-cycles the trampoline runtime of each process.

A process under our runtime pays the PEP 523 hook on every Python call. Its
descriptor (ABI 2, ``trampolines/ABI.md`` section 8) publishes what that
costs: the calls made through the hook and a measured extra cost per call.
Their product over the CPU time the process spent while the hook was on is
the share of its time spent in trampolines while on (``overhead_on``). To spend at most
``budget`` of it, the hook must be on ``budget / overhead_on`` of the time;
the runtime's own thread switches it on and off at a random phase of each
window once the daemon writes that duty cycle into the descriptor.

The first estimate comes at once, when the daemon finds the runtime: a
runtime that has never been paused has had its hook on since it started, so
its counters over the process's CPU time so far are a measurement already
(a short-lived worker would otherwise run unbudgeted for the two refreshes a
first interval takes). It counts CPU spent before the runtime started, so
the first interval's measurement replaces it instead of being smoothed in.
After that the estimate is smoothed (the workload's call rate varies) and
the duty cycle never goes below ``MIN_DUTY``, so even a process with a hot call path
keeps some named samples. Without a budget nothing is controlled: the
estimate is only exported, so it is measured every ``UNBUDGETED_SECONDS``,
not at every refresh (a ``/proc/PID/stat`` read per runtime process a second
was a tenth of a busy node's daemon CPU).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from tramprof.model import ProcessGone
from tramprof.procfs.identity import read_stat
from tramprof.procfs.memory import MemoryReadError, write_memory
from tramprof.unwind.descriptor import (
    DUTY_ALWAYS,
    DUTY_PPM_OFFSET,
    DutyState,
)

log = logging.getLogger(__name__)

#: The smallest share of time the hook is kept on.
MIN_DUTY = 0.01
#: Weight of a new measurement in the smoothed overhead.
SMOOTHING = 0.3
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Least CPU time with the hook on for a measurement to count (seconds).
MIN_ON_SECONDS = 0.05
#: Duty changes smaller than this (in millionths) are not written.
MIN_CHANGE_PPM = 5000
#: Without a budget, seconds between two measurements of a process.
UNBUDGETED_SECONDS = 10.0


@dataclass
class DutyProcess:
    """What the controller knows of one process."""

    address: int               # the descriptor's address in the process
    duty_ppm: int = DUTY_ALWAYS
    overhead_on: float | None = None   # smoothed share of time in trampolines while on
    last: DutyState | None = None
    last_at: float = 0.0       # CLOCK_MONOTONIC seconds of ``last``
    last_cpu: float = 0.0      # the process's CPU seconds at ``last``
    provisional: bool = False  # ``overhead_on`` is the lifetime estimate
    refused: bool = False      # a write of its duty cycle has failed (logged once)


def on_share(before: DutyState, after: DutyState, before_at: float, after_at: float) -> float:
    """Share of the time between two readings that the hook was on."""
    def paused_total(state: DutyState, at: float) -> float:
        open_pause = at - state.paused_since_ns / 1e9 if state.paused_since_ns else 0.0
        return state.off_ns / 1e9 + max(0.0, open_pause)
    wall = after_at - before_at
    if wall <= 0:
        return 0.0
    off = paused_total(after, after_at) - paused_total(before, before_at)
    return min(1.0, max(0.0, (wall - max(0.0, off)) / wall))


def duty_for(budget: float, overhead_on: float) -> float:
    """Share of time the hook may be on to spend ``budget`` of the process's time."""
    if overhead_on <= budget:
        return 1.0
    return max(MIN_DUTY, budget / overhead_on)


class DutyCycle:
    """Keeps every tracked process's duty cycle within the budget (0: no
    budget, the hook stays on; the overhead is still estimated)."""

    def __init__(self, budget: float = 0.0, proc_root: str = "/proc",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.budget = budget
        self._proc_root = proc_root
        self._clock = clock
        self._procs: dict[int, DutyProcess] = {}
        #: Writes of a duty cycle that failed while the process still ran:
        #: those processes stay always on whatever the budget.
        self.writes_failed = 0

    def track(self, pid: int, address: int) -> bool:
        """Follow ``pid``, whose ABI 2 descriptor lives at ``address``;
        whether it is new (its first ``update`` may then come at once)."""
        known = self._procs.get(pid)
        if known is None or known.address != address:
            self._procs[pid] = DutyProcess(address)
            return True
        return False

    def forget(self, pid: int) -> None:
        self._procs.pop(pid, None)

    def get(self, pid: int) -> DutyProcess | None:
        return self._procs.get(pid)

    def update(self, pid: int, state: DutyState) -> None:
        """One step for ``pid`` (once per refresh): measure, then set its duty.
        ``state``: its duty words, just read with its descriptor's generation
        (the chain mode's one read per process)."""
        proc = self._procs.get(pid)
        if proc is None:
            return
        now = self._clock()
        if self.budget <= 0 and proc.last is not None and state.duty_ppm == proc.duty_ppm \
                and now - proc.last_at < UNBUDGETED_SECONDS:
            return  # nothing to control; a duty set by someone else is undone at once
        try:
            cpu = read_stat(pid, self._proc_root).cpu_ticks / CLOCK_TICKS
        except (OSError, ProcessGone, ValueError):
            return
        if proc.last is None and state.call_cost_ps > 0 and state.off_ns == 0 \
                and state.paused_since_ns == 0 and cpu >= MIN_ON_SECONDS:
            # Never paused: on for the whole life of its counters.
            proc.overhead_on = min(1.0, state.hook_calls * state.call_cost_ps * 1e-12 / cpu)
            proc.provisional = True
        elif proc.last is not None and state.call_cost_ps > 0:
            # CPU time, not wall time: on a busy node the process does not
            # run all the time, and its calls per second of CPU are what the
            # hook costs it. The CPU spent while on: assumed proportional.
            seconds = (cpu - proc.last_cpu) * on_share(proc.last, state, proc.last_at, now)
            calls = state.hook_calls - proc.last.hook_calls
            if seconds >= MIN_ON_SECONDS and calls >= 0:
                measured = min(1.0, calls * state.call_cost_ps * 1e-12 / seconds)
                proc.overhead_on = measured if proc.overhead_on is None or proc.provisional \
                    else (1 - SMOOTHING) * proc.overhead_on + SMOOTHING * measured
                proc.provisional = False
        proc.last, proc.last_at, proc.last_cpu = state, now, cpu
        if self.budget <= 0:
            wanted = DUTY_ALWAYS  # no budget: always on (also undoes an earlier daemon's)
        elif proc.overhead_on is None:
            return
        else:
            wanted = round(duty_for(self.budget, proc.overhead_on) * DUTY_ALWAYS)
        if state.duty_ppm == proc.duty_ppm and abs(wanted - proc.duty_ppm) < MIN_CHANGE_PPM:
            return
        try:
            write_memory(pid, proc.address + DUTY_PPM_OFFSET, struct.pack("<I", wanted),
                         self._proc_root)
        except MemoryReadError as exc:
            if exc.errno in (errno.ESRCH, errno.ENOENT):
                return  # it has just exited: nothing to control
            self.writes_failed += 1
            # Once per process at warning: at debug, it would go unseen (a
            # daemon without the ptrace right never controls anything); at
            # every refresh, it would fill the journal.
            log.log(logging.DEBUG if proc.refused else logging.WARNING,
                    "pid %d: cannot set its duty cycle, its trampolines stay always on: %s",
                    pid, exc)
            proc.refused = True
            return
        if wanted != proc.duty_ppm:
            log.debug("pid %d: trampolines on %.1f%% of the time (%s overhead while on)",
                      pid, wanted / 1e4, "unknown" if proc.overhead_on is None
                      else f"{proc.overhead_on:.1%}")
        proc.duty_ppm = wanted

    def estimated_overhead(self, pid: int) -> float | None:
        """Share of the process's time spent in trampolines at its duty cycle."""
        proc = self._procs.get(pid)
        if proc is None or proc.overhead_on is None:
            return None
        return proc.overhead_on * proc.duty_ppm / DUTY_ALWAYS
