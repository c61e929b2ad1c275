"""The store of recent profile windows, for ``/profile`` and the index page."""

from __future__ import annotations

import threading
from collections import deque

from tramprof.model import Profile, merge


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
