"""The store of drained windows: bounded by age and by estimated memory, the
oldest leaving first, the newest always kept."""

from __future__ import annotations

import tracemalloc

from tramprof.export.store import ProfileStore, window_bytes
from tramprof.model import FrameSource, MappedFile, Profile, Stack

SECOND = 1_000_000_000
NAMES = tuple(f"function_{i}" for i in range(300))
SOURCES = tuple(FrameSource(0x1000 + i, MappedFile("/bin/app", 0, 1 << 20, 0))
                for i in range(300))


def window(start_s: int, stacks: int, depth: int = 40) -> Profile:
    """A 10 s window of ``stacks`` distinct stacks, each sampled once."""
    return Profile(tuple(Stack(pid=1, process="app", comm="app",
                               frames=tuple(NAMES[(s + d) % 300] for d in range(depth)),
                               count=1,
                               sources=tuple(SOURCES[(s + d) % 300] for d in range(depth)))
                         for s in range(stacks)),
                   start_s * SECOND, 10 * SECOND, 99)


def test_the_estimate_is_within_a_fifth_of_the_measured_memory() -> None:
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = window(0, 2000)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 <= window_bytes(kept) / measured <= 1.2, (window_bytes(kept), measured)


def test_age_bounds_a_quiet_node() -> None:
    store = ProfileStore(retention_seconds=30, max_bytes=1 << 30)
    for start in range(0, 100, 10):
        store.add(window(start, 10))
    held_bytes, held_seconds = store.held()
    # Windows ending within 30 s before the newest end (100 s): 70-80 ... 90-100.
    assert held_seconds == 40.0
    assert held_bytes == 4 * window_bytes(window(0, 10))
    assert store.last(300, 99).duration_ns == 40 * SECOND


def test_memory_bounds_a_node_with_many_distinct_stacks() -> None:
    one = window_bytes(window(0, 1000))
    store = ProfileStore(retention_seconds=300, max_bytes=3 * one + one // 2)
    for start in range(0, 100, 10):
        store.add(window(start, 1000))
    held_bytes, held_seconds = store.held()
    assert (held_bytes, held_seconds) == (3 * one, 30.0)
    profile = store.last(300, 99)
    assert profile.start_ns == 70 * SECOND
    assert sum(stack.count for stack in profile.stacks) == 3000


def test_the_newest_window_stays_even_when_it_alone_is_over_the_limit() -> None:
    store = ProfileStore(retention_seconds=300, max_bytes=1)
    store.add(window(0, 5))
    store.add(window(10, 5))
    assert store.held() == (window_bytes(window(10, 5)), 10.0)
    assert store.last(60, 99).start_ns == 10 * SECOND
