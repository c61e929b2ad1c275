"""The store of recent profile windows, for ``/profile`` and the index page."""

from __future__ import annotations

import threading
from collections import deque

from tramprof.model import Profile, merge

#: Estimated bytes of one stored stack: the Stack object and its dict, and
#: the two tuples (frames, sources) without their items; plus ``ITEM_BYTES``
#: per frame for each tuple's slot. Names and frame sources are shared by
#: every stack that has them (measured with tracemalloc: 860 bytes for a
#: 40-frame stack).
STACK_BYTES = 220
ITEM_BYTES = 16


def window_bytes(window: Profile) -> int:
    """Estimated memory a stored window holds (its names and sources shared)."""
    return sum(STACK_BYTES + ITEM_BYTES * len(stack.frames) for stack in window.stacks)


class ProfileStore:
    """The most recent drained windows, for ``/profile`` and the index page.

    Bounded by age (``retention_seconds``), count and estimated memory
    (``max_bytes``): the oldest windows leave first, so a node with very many
    distinct stacks keeps fewer seconds rather than more memory. The newest
    window is always kept. The daemon's loop adds; HTTP threads read.
    """

    def __init__(self, retention_seconds: float = 300, max_windows: int = 1000,
                 max_bytes: int = 16 << 20) -> None:
        self.reconfigure(retention_seconds, max_bytes)
        self._windows: deque[tuple[Profile, int]] = deque(maxlen=max_windows)
        self._bytes = 0
        self._lock = threading.Lock()

    def reconfigure(self, retention_seconds: float, max_bytes: int) -> None:
        """New bounds (a configuration reload); they apply from the next window."""
        self.retention_ns = int(retention_seconds * 1e9)
        self.max_bytes = max_bytes

    def add(self, window: Profile) -> None:
        size = window_bytes(window)
        with self._lock:
            if len(self._windows) == self._windows.maxlen:
                self._bytes -= self._windows[0][1]
            self._windows.append((window, size))
            self._bytes += size
            newest_end = window.start_ns + window.duration_ns
            while len(self._windows) > 1:
                oldest, oldest_size = self._windows[0]
                if (oldest.start_ns + oldest.duration_ns >= newest_end - self.retention_ns
                        and self._bytes <= self.max_bytes):
                    break
                self._windows.popleft()
                self._bytes -= oldest_size

    def held(self) -> tuple[int, float]:
        """Estimated bytes held, and the seconds of samples the windows cover."""
        with self._lock:
            if not self._windows:
                return 0, 0.0
            first, last = self._windows[0][0], self._windows[-1][0]
            return self._bytes, (last.start_ns + last.duration_ns - first.start_ns) / 1e9

    def last(self, seconds: float, frequency_hz: int) -> Profile:
        """Windows that end within the last ``seconds`` before the newest one."""
        with self._lock:
            windows = [window for window, _size in self._windows]
        if not windows:
            return Profile((), 0, 0, frequency_hz)
        newest_end = windows[-1].start_ns + windows[-1].duration_ns
        cutoff = newest_end - int(seconds * 1e9)
        return merge([w for w in windows if w.start_ns + w.duration_ns > cutoff], frequency_hz)
