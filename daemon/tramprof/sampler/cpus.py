"""Which online CPUs the sampling events still sample.

The sampler opens one perf event per online CPU at start. A CPU that comes
online later has none. A CPU taken offline loses its events for good: the
kernel takes them out of the CPU's context, and they stay out once it is
back online (measured on Linux 6.18: no sample from that CPU again, with
PERF_EVENT_IOC_ENABLE too). Opening new events needs CAP_PERFMON, which the
running daemon has given up (``commands.privileges``), so such CPUs can
only be reported: the daemon must be restarted to sample them.

Reading an event's count needs no capability. A live event's count grows
whenever its CPU runs anything (cpu-clock even while it idles); a removed
one's never again. So a CPU is reported when it has no event, or when
``/proc/stat`` shows it busy since the last check while its event counted
nothing. A CPU idle throughout is not reported: there was nothing to miss.
Detection thus takes two checks after the CPU is back.

/proc/stat lists exactly the online CPUs, so one read (~60 us) answers
both which CPUs are online and how busy; /sys/devices/system/cpu/online
costs ~200 us more after a sleep.
"""

from __future__ import annotations

import logging
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

log = logging.getLogger(__name__)

#: /proc/stat is ~150 bytes a CPU: room for 8,192 CPUs.
MAX_PROC_STAT: Final = 2 << 20
_COUNT: Final = struct.Struct("=Q")


@dataclass(frozen=True)
class CpuReading:
    """One CPU at one check."""

    event_count: int | None  # None: no sampling event on it (or unreadable)
    busy_ticks: int          # non-idle time from /proc/stat, in clock ticks


def busy_ticks(proc_stat: str) -> dict[int, int]:
    """Each online CPU's non-idle time (user, nice, system, irq, softirq;
    not idle, iowait or steal) from the text of /proc/stat."""
    busy: dict[int, int] = {}
    for line in proc_stat.splitlines():
        if not line.startswith("cpu") or line[3:4] == " ":
            continue  # the all-CPU line, or not a CPU
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
        except ValueError:
            continue
        busy[cpu] = user + nice + system + irq + softirq
    return busy


def unsampled(before: Mapping[int, CpuReading], now: Mapping[int, CpuReading]) -> list[int]:
    """The CPUs of ``now`` (the online ones) with no sampling event, or busy
    since ``before`` while their event counted nothing."""
    missed = []
    for cpu, reading in sorted(now.items()):
        last = before.get(cpu)
        stopped = (last is not None and last.event_count == reading.event_count
                   and reading.busy_ticks > last.busy_ticks)
        if reading.event_count is None or stopped:
            missed.append(cpu)
    return missed


class CpuWatch:
    """Checks, now and then, that every online CPU is sampled; each check
    compares with the one before."""

    def __init__(self, proc_stat: str = "/proc/stat") -> None:
        self._proc_stat = proc_stat
        self._last: dict[int, CpuReading] = {}

    def check(self, events: Mapping[int, int]) -> list[int]:
        """Online CPUs not sampled; ``events``: CPU -> its sampling event's
        descriptor."""
        with open(self._proc_stat, "rb") as f:
            busy = busy_ticks(f.read(MAX_PROC_STAT).decode("ascii", "replace"))
        now: dict[int, CpuReading] = {}
        for cpu in busy:
            count = None
            fd = events.get(cpu)
            if fd is not None:
                try:
                    count = _COUNT.unpack(os.read(fd, _COUNT.size))[0]
                except (OSError, struct.error) as exc:
                    log.debug("cannot read the sampling event of CPU %d: %s", cpu, exc)
            now[cpu] = CpuReading(count, busy[cpu])
        before, self._last = self._last, now
        return unsampled(before, now)
