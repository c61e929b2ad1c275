"""When the samples being named were taken, which decides whether a lookup
that misses reads a process's maps or JIT files again.

A process maps memory before it runs code there, and a runtime writes a
perf map or jitdump entry before it runs the code the entry names. So a read
made after a sample was taken answers for that sample, and a read made
before it may not: a Python runtime that has just been switched on writes an
entry per function as each is first called, so a read made a moment earlier
misses those called since. A lookup that misses therefore reads again when
the last read began before the samples being named were all taken. Apart
from that, it reads again at most once per interval: no read can answer some
misses (a wrong frame address), and they must not cost a read each.
"""

from __future__ import annotations

import math


class SampleHorizon:
    """The time (monotonic seconds) by which the samples being named were
    all taken; one object, shared by every process's readers."""

    __slots__ = ("taken_by",)

    def __init__(self) -> None:
        #: -inf until samples are named: only the interval then.
        self.taken_by = -math.inf

    def may_read_again(self, last_read: float, now: float, interval: float) -> bool:
        """Whether a miss may read again what was last read at ``last_read``."""
        return last_read < self.taken_by or now - last_read >= interval
