"""Python interpreters sampled before they loaded what an unwinding mode looks for.

A process is shown to the unwinding modes when it is first sampled, which
at any sampling rate is within milliseconds of its exec for a process that
runs at all. A Python interpreter has not yet imported what would put it
under a trampoline mode then: our runtime's extension (from a ``.pth``
file, ``sitecustomize`` or the program's own import) or CPython's ``-X
perf`` trampolines. Its maps were otherwise read again only when a drain
met an address they did not cover, every ``interval`` (10 s by default): a
worker that lived less than that ran its whole life with neither Python
frames nor its overhead budget. So each young interpreter's maps are read
again a few times in its first seconds, until a mode takes it.

A maps read, with the modes' look at them, costs 0.3-0.6 ms of CPU for an
interpreter (100-200 mappings); a node starting 20 interpreters a second
that never load trampolines paid 2% of a core for them. So a look reads the
maps only if the process has written its perf map (opened and closed
through the hardened path, ~10 us: both trampoline modes name frames from
it, and write it as their first stub is made) and its address space changed
size since the last look that read them (``/proc/PID/stat``'s vsize, ~10
us): loading a runtime maps its extension and arenas. Other programs are
never followed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable

from tramprof.pipeline.naming import ImageKey
from tramprof.procfs.maps import Mapping

#: Seconds after the first sighting at which the maps are read again: the
#: runtime loads at start-up (tens of ms) or when the program activates it.
LOOK_AFTER = (0.1, 0.5, 2.0)
#: Young interpreters followed at once; beyond, new ones wait for a drain.
MAX_FOLLOWED = 512
#: The interpreter's executable or shared library (python3.11, python3.13t,
#: libpython3.12.so.1.0), as /proc/PID/maps names it.
INTERPRETER_RE = re.compile(r"(?:^|/)(?:lib)?python3(?:\.\d+)?[a-z]*(?:\.so[.\d]*)?$")


def is_interpreter(mappings: Iterable[Mapping]) -> bool:
    """Whether a CPython interpreter runs in the process (its executable or
    libpython is mapped executable)."""
    return any(m.is_exec and not m.is_anonymous and INTERPRETER_RE.search(m.path)
               for m in mappings)


class YoungInterpreters:
    """The looks still due, per process image."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # key -> (first seen, looks done, vsize at the last look; 0: none yet)
        self._looks: dict[ImageKey, tuple[float, int, int]] = {}

    def __len__(self) -> int:
        return len(self._looks)

    def add(self, key: ImageKey) -> None:
        """Follow ``key``, first sampled now."""
        if key not in self._looks and len(self._looks) < MAX_FOLLOWED:
            self._looks[key] = (self._clock(), 0, 0)

    def seconds_to_next(self) -> float | None:
        """Until the earliest look is due (None: nothing followed)."""
        if not self._looks:
            return None
        now = self._clock()
        return max(0.0, min(seen + LOOK_AFTER[done] - now
                            for seen, done, _ in self._looks.values()))

    def take_due(self) -> list[tuple[ImageKey, int]]:
        """The images whose next look is due, with the vsize their last look
        saw (0: none); each is followed until its last look."""
        now = self._clock()
        due = [(key, vsize) for key, (seen, done, vsize) in self._looks.items()
               if now >= seen + LOOK_AFTER[done]]
        for key, vsize in due:
            seen, done, _ = self._looks[key]
            if done + 1 < len(LOOK_AFTER):
                self._looks[key] = (seen, done + 1, vsize)
            else:
                del self._looks[key]
        return due

    def saw(self, key: ImageKey, vsize: int) -> None:
        """A look read the maps of ``key`` at this address-space size."""
        if key in self._looks:
            seen, done, _ = self._looks[key]
            self._looks[key] = (seen, done, vsize)

    def forget(self, pid: int) -> None:
        for key in [key for key in self._looks if key[0] == pid]:
            del self._looks[key]

    def forget_exited(self, live: set[int]) -> None:
        for key in [key for key in self._looks if key[0] not in live]:
            del self._looks[key]
