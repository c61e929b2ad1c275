"""When the cyclic garbage collector looks at the daemon's heap.

What a drain creates (samples, stacks, the windows the store keeps for
minutes) and what symbolization keeps (symbol tables, perf map indexes) are
long-lived and free of reference cycles: reference counting frees them. Yet
CPython's collector walks them again and again as they age through its
generations: on a busy node (200 processes, ~1,300 distinct stacks a
window) a full collection took 300-700 ms every 15-30 s and the young ones
~100 ms after each drain, together about half of the daemon's CPU time.

So each drain runs with the collector paused, and at its end everything
alive is frozen (``gc.freeze``: out of the collector's sight, still freed
by reference counting); the collector only sees what is created between
two drains. Cycles that become
garbage after they were frozen (a parsed ELF file dropped later, say) are
found by a full collection of everything, unfrozen, every
``FULL_COLLECTION_SECONDS``: garbage in cycles (pyelftools makes ~400
objects of it per ELF file it opens) lives a few minutes longer, never for
good. Measured there: collections took ~3.4 s of every minute before;
after, young collections ~0.15 s a minute and one full collection of
0.4-0.9 s (it holds the interpreter lock: /metrics waits) every five
minutes. Once the node is steady a full collection finds next to nothing
(new ELF files are rare): while each finds fewer than ``LITTLE_GARBAGE``
objects, the wait for the next doubles, up to ``MAX_FULL_COLLECTION_SECONDS``,
and a collection that finds more brings it back. Garbage held meanwhile
stays under about twice that bound (a few MiB).

Memory freed by a drain goes back to the C allocator, which keeps it: glibc
returns only what lies at the top of its heap. After each drain its free
pages are handed back to the kernel (``malloc_trim``): on the busy node the
daemon's resident memory was 7-13 MiB lower for 0.2-0.8 ms a drain. Where the C
library has no such call (musl), nothing is trimmed.

That trim reaches the whole of glibc's main arena only: a thread that
allocates gets an arena of its own, whose free top stays resident until
more than the trim threshold is free there (glibc raises it with the
largest block freed, up to 64 MiB). An HTTP thread rendering one
``/profile?seconds=60`` (7.6 MB of folded stacks) on the busy node kept
its arena at 24 MiB resident for good: 161 against 139 MiB. So every
thread allocates from the main arena (``mallopt(M_ARENA_MAX, 1)``, set
before the daemon starts its threads); the interpreter lock lets one
thread allocate at a time anyway. Measured there with one render each:
131 against 165 MiB, the render's memory back at the next drain.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: Seconds between full collections of the whole heap (frozen part included)
#: while they find garbage.
FULL_COLLECTION_SECONDS = 300.0
#: The longest wait between two full collections.
MAX_FULL_COLLECTION_SECONDS = 3600.0
#: Unreachable objects a full collection may find and still double the wait
#: for the next (~100 bytes each).
LITTLE_GARBAGE = 10_000


def _libc_call(name: str, *argtypes: type) -> Any | None:
    """The C library's function ``name`` (returning int), None where it has none."""
    try:
        function = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


def malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``: free pages anywhere in its heaps go back
    to the kernel. None where the C library has no such call."""
    trim = _libc_call("malloc_trim", ctypes.c_size_t)
    return None if trim is None else lambda: trim(0)


#: glibc's ``mallopt`` parameter for the most arenas (``malloc.h``).
M_ARENA_MAX = -8


def one_malloc_arena() -> bool:
    """Have every thread allocate from glibc's main arena, which
    ``malloc_trim`` trims whole; False where the C library cannot."""
    mallopt = _libc_call("mallopt", ctypes.c_int, ctypes.c_int)
    return mallopt is not None and bool(mallopt(M_ARENA_MAX, 1))


class HeapPolicy:
    """Freezes the heap after each drain; collects all of it now and then;
    gives the C allocator's free pages back after each drain, from one
    arena for all threads (made before the threads that allocate)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 full_every: float = FULL_COLLECTION_SECONDS,
                 trim: Callable[[], object] | None = None,
                 max_full_every: float = MAX_FULL_COLLECTION_SECONDS,
                 little_garbage: int = LITTLE_GARBAGE) -> None:
        self._clock = clock
        self._full_every = full_every
        self._max_full_every = max(full_every, max_full_every)
        self._little_garbage = little_garbage
        #: Seconds from the last full collection to the next.
        self.full_wait = full_every
        self._next_full = clock() + full_every
        self._trim = trim if trim is not None else malloc_trim()
        self.one_arena = one_malloc_arena()
        self.full_collections = 0
        self.full_collection_seconds = 0.0

    def after_drain(self) -> None:
        now = self._clock()
        if now >= self._next_full:
            began = time.perf_counter()
            gc.unfreeze()
            found = gc.collect()
            self.full_collection_seconds += time.perf_counter() - began
            self.full_collections += 1
            self.full_wait = (min(self.full_wait * 2, self._max_full_every)
                              if found < self._little_garbage else self._full_every)
            self._next_full = now + self.full_wait
            log.debug("full collection: %d unreachable objects in %.0f ms; next in %.0f s",
                      found, (time.perf_counter() - began) * 1e3, self.full_wait)
        gc.freeze()
        if self._trim is not None:
            self._trim()

    def close(self) -> None:
        """Give the frozen objects back to the collector."""
        gc.unfreeze()
