"""A profile: aggregated stacks over a time range, the input of every writer
(folded, pprof, speedscope, flame graph), and the store of recent ones."""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass

from tramprof.unwind import Stack


@dataclass(frozen=True)
class Profile:
    """Stacks sampled between ``start_ns`` and ``start_ns + duration_ns``
    (CLOCK_REALTIME, ns); each sample stands for 1/``frequency_hz`` s of CPU."""

    stacks: tuple[Stack, ...]
    start_ns: int
    duration_ns: int
    frequency_hz: int

    @property
    def period_ns(self) -> int:
        return 1_000_000_000 // self.frequency_hz

    @property
    def total_samples(self) -> int:
        return sum(s.count for s in self.stacks)

    def only_pids(self, pids: set[int]) -> Profile:
        return Profile(tuple(s for s in self.stacks if s.pid in pids), self.start_ns,
                       self.duration_ns, self.frequency_hz)


def merge(profiles: list[Profile], frequency_hz: int) -> Profile:
    """One profile covering all of ``profiles`` with identical stacks summed."""
    if not profiles:
        return Profile((), 0, 0, frequency_hz)
    counts: Counter[tuple[int, str, str, tuple[str, ...]]] = Counter()
    for profile in profiles:
        for s in profile.stacks:
            counts[(s.pid, s.process, s.comm, s.frames)] += s.count
    start = min(p.start_ns for p in profiles)
    end = max(p.start_ns + p.duration_ns for p in profiles)
    stacks = tuple(Stack(pid=pid, process=process, comm=comm, frames=frames, count=count)
                   for (pid, process, comm, frames), count in counts.items())
    return Profile(stacks, start, end - start, frequency_hz)


class ProfileStore:
    """The most recent drained windows, for ``/profile`` and the index page.

    Bounded by age (``retention_seconds``) and count, so memory stays flat.
    The daemon's loop adds; HTTP threads read.
    """

    def __init__(self, retention_seconds: float = 300, max_windows: int = 1000) -> None:
        self.retention_ns = int(retention_seconds * 1e9)
        self._windows: deque[Profile] = deque(maxlen=max_windows)
        self._lock = threading.Lock()

    def add(self, window: Profile) -> None:
        with self._lock:
            self._windows.append(window)
            newest_end = window.start_ns + window.duration_ns
            while self._windows and (self._windows[0].start_ns + self._windows[0].duration_ns
                                     < newest_end - self.retention_ns):
                self._windows.popleft()

    def last(self, seconds: float, frequency_hz: int) -> Profile:
        """Windows that end within the last ``seconds`` before the newest one."""
        with self._lock:
            windows = list(self._windows)
        if not windows:
            return Profile((), 0, 0, frequency_hz)
        newest_end = windows[-1].start_ns + windows[-1].duration_ns
        cutoff = newest_end - int(seconds * 1e9)
        return merge([w for w in windows if w.start_ns + w.duration_ns > cutoff], frequency_hz)
