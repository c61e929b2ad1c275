"""The heap policy: frozen after each drain, out of the collector's sight;
cycles that become garbage once frozen are still freed, at the next full
collection."""

from __future__ import annotations

import gc
import weakref

from tramprof.pipeline.heap import HeapPolicy


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_frozen_cycles_wait_for_the_full_collection():
    now = [0.0]
    policy = HeapPolicy(clock=lambda: now[0], full_every=300)
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
        assert gc.get_freeze_count() > 0
    finally:
        policy.close()
    assert gc.get_freeze_count() == 0
