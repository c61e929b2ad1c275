"""The heap policy: frozen after each drain, out of the collector's sight;
cycles that become garbage once frozen are still freed, at the next full
collection."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from tramprof.pipeline.heap import HeapPolicy, malloc_trim


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_cycles_wait_for_the_full_collection():
    now = [0.0]
    policy = HeapPolicy(clock=lambda: now[0], full_every=300, little_garbage=0)
    try:
        young = cycle()  # garbage already: the collector still sees it
        gc.collect()
        assert young() is None

        held = Node()
        held.other = Node()
        held.other.other = held
        frozen = weakref.ref(held)
        policy.after_drain()
        assert gc.get_freeze_count() > 0
        del held  # now garbage, but frozen: ordinary collections miss it
        gc.collect()
        assert frozen() is not None

        now[0] = 299.0
        policy.after_drain()
        gc.collect()
        assert frozen() is not None and policy.full_collections == 0

        now[0] = 300.0
        policy.after_drain()  # unfreezes, collects everything, freezes again
        assert frozen() is None and policy.full_collections == 1
        assert policy.full_collection_seconds > 0  # measured, not counted
        assert gc.get_freeze_count() > 0
    finally:
        policy.close()
    assert gc.get_freeze_count() == 0


def test_full_collections_wait_longer_while_they_find_little_garbage():
    """A steady heap is walked whole less and less often, down to once an
    hour; garbage found again brings the wait back to the start."""
    now = [0.0]
    policy = HeapPolicy(clock=lambda: now[0], full_every=300, max_full_every=1000,
                        little_garbage=50)
    try:
        waits = []
        for _ in range(4):
            now[0] += policy.full_wait
            gc.collect()  # what an ordinary collection finds is not counted
            policy.after_drain()
            waits.append(policy.full_wait)
        assert waits == [600, 1000, 1000, 1000] and policy.full_collections == 4

        for _ in range(100):  # 100 self-cycles, garbage at once
            a = Node()
            a.other = a
        del a
        now[0] += 999  # not due yet: the garbage is frozen with the rest
        policy.after_drain()
        assert policy.full_collections == 4
        now[0] += 1
        policy.after_drain()  # finds the 100 cycles
        assert policy.full_collections == 5 and policy.full_wait == 300
    finally:
        policy.close()


def rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_memory_a_drain_freed_goes_back_to_the_kernel():
    """Freed memory below the top of glibc's heap stays resident until it is
    trimmed: after a drain it is given back."""
    trim = malloc_trim()
    assert trim is not None, "glibc has malloc_trim"
    policy = HeapPolicy(trim=trim)
    try:
        # 64 MiB in blocks glibc serves from its heap (below its mmap
        # threshold), then a small one on top that keeps the heap from
        # shrinking when the rest is freed.
        blocks = [bytearray(64 << 10) for _ in range(1024)]
        for block in blocks:
            block[::4096] = b"x" * len(block[::4096])  # touch every page
        pin = bytearray(64 << 10)
        del blocks
        before = rss_kib()
        policy.after_drain()
        after = rss_kib()
        assert before - after > 48 << 10, (before, after)
        del pin
    finally:
        policy.close()


RENDER_IN_A_THREAD = """
import threading
from tramprof.pipeline.heap import HeapPolicy

def rss_kib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))

def render():
    # What rendering a large profile does: line strings, the text joined
    # from them, its encoding (~7 MB each).
    lines = ["x" * 1200 + str(i) for i in range(6000)]
    body = "\\n".join(lines).encode()
    del lines
    return len(body)

policy = HeapPolicy()
before = rss_kib()
thread = threading.Thread(target=render)
thread.start()
thread.join()
policy.after_drain()
print(policy.one_arena, rss_kib() - before)
"""


def test_memory_a_thread_freed_goes_back_to_the_kernel_after_a_drain():
    """A profile rendered by an HTTP thread: what it freed is given back by
    the trim after the next drain (glibc's own arena for the thread kept
    it). In a fresh interpreter: the test process has made its threads."""
    proc = subprocess.run([sys.executable, "-c", RENDER_IN_A_THREAD], capture_output=True,
                          text=True, timeout=60, check=True)
    one_arena, grown_kib = proc.stdout.split()
    assert one_arena == "True"
    assert int(grown_kib) < 2 << 10, f"{grown_kib} KiB still resident (rendered ~7 MB)"
