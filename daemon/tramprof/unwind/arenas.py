"""Where a process's trampoline stubs are: the one "is this address a stub" test.

Both trampoline modes know a process's stubs as arenas, page-aligned ranges
of anonymous executable memory that hold nothing but stub copies (our
runtime's, from its descriptor; CPython's, from its perf map and verified
byte for byte). The merge drops a stub's own native frame by this test.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator


class Arenas:
    """An immutable set of non-overlapping ``[start, end)`` address ranges.
    Lookups are O(log n) (a process has one arena per 64 KiB of stubs)."""

    __slots__ = ("_ends", "_ranges", "_starts")

    def __init__(self, ranges: Iterable[tuple[int, int]] = ()) -> None:
        merged: list[tuple[int, int]] = []
        for start, end in sorted((int(s), int(e)) for s, e in ranges):
            if end <= start:
                raise ValueError(f"empty or inverted arena {start:#x}-{end:#x}")
            if merged and start < merged[-1][1]:
                raise ValueError(f"arena {start:#x}-{end:#x} overlaps {merged[-1][0]:#x}-"
                                 f"{merged[-1][1]:#x}")
            merged.append((start, end))
        self._ranges = tuple(merged)
        self._starts = [s for s, _ in merged]
        self._ends = [e for _, e in merged]

    def __contains__(self, address: object) -> bool:
        if not isinstance(address, int):
            return False
        at = bisect.bisect_right(self._starts, address) - 1
        return at >= 0 and address < self._ends[at]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._ranges)

    def __len__(self) -> int:
        return len(self._ranges)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Arenas) and self._ranges == other._ranges

    def __hash__(self) -> int:
        return hash(self._ranges)

    def __repr__(self) -> str:
        return "Arenas(" + ", ".join(f"{s:#x}-{e:#x}" for s, e in self._ranges) + ")"

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return self._ranges

    @property
    def bounds(self) -> tuple[int, int]:
        """``[start, end)`` around every arena (empty: ``(0, 0)``): a test
        that rules out most addresses without a search."""
        return (self._starts[0], self._ends[-1]) if self._ranges else (0, 0)

    @property
    def search_lists(self) -> tuple[list[int], list[int]]:
        """The arenas' starts and ends, each sorted, for a compiled search
        that reads them as they are (never to be changed)."""
        return self._starts, self._ends

    @property
    def size(self) -> int:
        """Bytes covered by all arenas."""
        return sum(e - s for s, e in self._ranges)

    def union(self, other: Iterable[tuple[int, int]]) -> Arenas:
        return Arenas({*self._ranges, *other})

    def slot_start(self, address: int, stride: int) -> int | None:
        """Start of the stub slot (``stride`` bytes, from the arena's start)
        holding ``address``; None outside every arena."""
        at = bisect.bisect_right(self._starts, address) - 1
        if at < 0 or address >= self._ends[at]:
            return None
        start = self._starts[at]
        return start + (address - start) // stride * stride
