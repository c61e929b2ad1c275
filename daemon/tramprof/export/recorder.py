"""Profiles of the next N seconds, as Go's ``/debug/pprof/profile?seconds=N``
records them: the answer covers the samples taken from the request on, for N
seconds, and comes when they are in.

The kernel buffers are the only place samples are, and only the daemon's loop
drains them, so a recording is bounded by drains: the first drain to start
after the request (its buffer flip is where the recording begins), and the
first to start N seconds after that one started (its flip is where it ends).
Both are asked for: an HTTP thread sets a flag and wakes the loop through an
eventfd, so neither boundary waits for the regular drain interval. The
windows drained in between are the recording, whatever else drains in the
meantime (the regular interval, other recordings).

Thread roles: the daemon's loop calls ``drain_due``, ``drain_started`` and
``drain_finished``; HTTP threads call ``record``. One condition variable
guards the drain counters and the recordings in progress.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tramprof.model import Profile, merge

#: How long a recording waits for the daemon's loop to drain at one of its
#: boundaries before it gives up: the loop wakes at once, but a drain that is
#: already running (symbolizing a busy host) has to finish first.
BOUNDARY_TIMEOUT = 30.0


class RecordingFailed(Exception):
    """The recording could not be completed (the daemon stops, or its loop did
    not drain in time); the message says which."""


@dataclass
class _Recording:
    seconds: float
    first: int  # the drain that starts the recording (its flip)
    began: float | None = None  # monotonic time that drain started
    last: int | None = None  # the first drain to start ``seconds`` after that
    windows: list[Profile] = field(default_factory=list)


class Recorder:
    """Drain boundaries on demand, and the windows between them."""

    def __init__(self, frequency: Callable[[], int],
                 boundary_timeout: float = BOUNDARY_TIMEOUT,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._frequency = frequency
        self._boundary_timeout = boundary_timeout
        self._clock = clock
        self._cond = threading.Condition()
        self._started = 0  # drains begun
        self._finished = 0  # drains done
        self._requested = False
        self._closed = False
        self._recordings: list[_Recording] = []
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    # ------------------------------------------------------ the daemon's loop

    def fileno(self) -> int:
        """Readable when a recording wants a drain now (for select)."""
        return self._wake

    def drain_due(self) -> bool:
        with self._cond:
            return self._requested and not self._closed

    def drain_started(self) -> None:
        """Call right before the kernel buffers are flipped."""
        now = self._clock()
        with self._cond:
            self._requested = False
            if not self._closed:
                with contextlib.suppress(BlockingIOError):
                    os.eventfd_read(self._wake)
            self._started += 1
            for recording in self._recordings:
                if recording.began is None:
                    if self._started == recording.first:
                        recording.began = now
                elif recording.last is None and now >= recording.began + recording.seconds:
                    recording.last = self._started

    def drain_finished(self, window: Profile | None) -> None:
        """Call when the drain begun last is done, with its window (None if
        it failed: its samples are lost to every reader alike)."""
        with self._cond:
            number = self._started
            for recording in self._recordings:
                if (window is not None and recording.began is not None
                        and recording.first < number
                        and (recording.last is None or number <= recording.last)):
                    recording.windows.append(window)
            self._finished = number
            self._cond.notify_all()

    def close(self) -> None:
        """The daemon stops: recordings in progress fail at once."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            os.close(self._wake)

    # ------------------------------------------------------------ HTTP threads

    def record(self, seconds: float) -> Profile:
        """The samples of the next ``seconds``; blocks that long and for two
        drains. Raises RecordingFailed."""
        with self._cond:
            recording = _Recording(seconds, first=self._started + 1)
            self._recordings.append(recording)
            try:
                self._boundary(recording.first)
                assert recording.began is not None
                end = recording.began + seconds
                while recording.last is None and (left := end - self._clock()) > 0:
                    self._check_open()
                    self._cond.wait(left)
                # Unless a drain that started since is the end already.
                if recording.last is None:
                    recording.last = self._started + 1
                self._boundary(recording.last)
            finally:
                self._recordings.remove(recording)
        return merge(recording.windows, self._frequency())

    def _boundary(self, drain: int) -> None:
        """Ask for drain number ``drain`` unless it has begun, and wait until
        it is done (the condition is held)."""
        self._check_open()
        if self._started < drain:
            self._requested = True
            os.eventfd_write(self._wake, 1)
        deadline = self._clock() + self._boundary_timeout
        while self._finished < drain:
            self._check_open()
            left = deadline - self._clock()
            if left <= 0:
                raise RecordingFailed(f"the daemon did not drain within "
                                      f"{self._boundary_timeout:.0f} s")
            self._cond.wait(left)

    def _check_open(self) -> None:
        if self._closed:
            raise RecordingFailed("the daemon is stopping")
