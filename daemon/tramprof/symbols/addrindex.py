"""Address-range index where the newest entry wins.

JIT runtimes reuse addresses: code is freed and new code is written over it,
and the runtime then appends a new perf map line or jitdump record for the
same range.  perf does not resolve such overlaps; a live profiler must, or it
reports long-dead functions.

Layout: resolved ranges are kept sorted and non-overlapping in two layers,
each ``array('Q')`` starts/ends plus a list of values, so a lookup is one
``bisect`` per layer:

* ``base`` -- the bulk, rebuilt rarely;
* ``overlay`` -- ranges added since the last base rebuild, all newer than
  anything in ``base`` and therefore consulted first.

New entries are buffered and resolved lazily on the next lookup.  Resolving
a batch sorts it and sweeps only the clusters of overlapping ranges (none in
the common case).  The batch is then laid over the overlay (spliced in
place when it is a handful of ranges, merged otherwise); when the overlay
grows past ``max(4096, len(base) // 16)`` ranges it is merged into the base.
Merges copy untouched runs as array slices and walk only the ranges that
overlap, so appending one entry costs O(log n) Python work plus a memmove
within the overlay, and base rebuilds are amortised over 1/16 of its size.

A value of ``None`` is a tombstone: it hides older ranges (used when a
jitdump CODE_MOVE vacates a range) and is dropped once merged into the base.

The index also tells which ranges may answer differently since it was last
asked (``take_changes``): the ranges added meanwhile, since a lookup outside
them gives what it gave before. Callers that cache answers by address (a
node process appends perf map lines all the time) then forget only those.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence
from itertools import accumulate, compress, pairwise
from operator import gt, le
from typing import Final, Generic, TypeVar

T = TypeVar("T")

U64_MAX: Final = (1 << 64) - 1
_OVERLAY_MIN: Final = 4096
_OVERLAY_FRACTION: Final = 16
# Batches up to this size are spliced into the overlay in place.
_SPLICE_MAX: Final = 8
#: Ranges ``take_changes`` reports at most; past that, "everything".
MAX_CHANGES: Final = 4096


class _Layer(Generic[T]):
    """Sorted, non-overlapping ranges ``[starts[i], ends[i])`` -> ``values[i]``."""

    __slots__ = ("ends", "starts", "tombstones", "values")

    def __init__(
        self,
        starts: array[int] | None = None,
        ends: array[int] | None = None,
        values: list[T | None] | None = None,
    ) -> None:
        self.starts: array[int] = starts if starts is not None else array("Q")
        self.ends: array[int] = ends if ends is not None else array("Q")
        self.values: list[T | None] = values if values is not None else []
        self.tombstones = self.values.count(None) if self.values else 0

    def __len__(self) -> int:
        return len(self.starts)

    def find(self, addr: int) -> int:
        """Index of the range containing ``addr``, or -1."""
        i = bisect_right(self.starts, addr) - 1
        if i >= 0 and addr < self.ends[i]:
            return i
        return -1

    def splice(self, start: int, end: int, value: T | None) -> None:
        """Lay one range over this layer in place (it wins where they overlap).

        Costs a memmove of the layer's tail: cheap for the small overlay,
        where it beats building a merged copy.
        """
        starts, ends, values = self.starts, self.ends, self.values
        i = bisect_right(ends, start)  # first range ending after start
        j = bisect_left(starts, end, i)  # first range starting at/after end
        new_starts = [start]
        new_ends = [end]
        new_values = [value]
        if i < j:
            if starts[i] < start:
                new_starts.insert(0, starts[i])
                new_ends.insert(0, start)
                new_values.insert(0, values[i])
            if ends[j - 1] > end:
                new_starts.append(end)
                new_ends.append(ends[j - 1])
                new_values.append(values[j - 1])
            self.tombstones -= values[i:j].count(None)
        self.tombstones += new_values.count(None)
        starts[i:j] = array("Q", new_starts)
        ends[i:j] = array("Q", new_ends)
        values[i:j] = new_values

    def without_tombstones(self) -> _Layer[T]:
        if not self.tombstones:
            return self
        keep = [v is not None for v in self.values]
        return _Layer(
            array("Q", compress(self.starts, keep)),
            array("Q", compress(self.ends, keep)),
            list(compress(self.values, keep)),
        )


def _resolve(starts: array[int], ends: array[int], values: list[T | None]) -> _Layer[T]:
    """Turn ranges listed oldest-first into a newest-wins layer."""
    n = len(starts)
    if n == 0:
        return _Layer()
    if all(map(le, starts[:-1], starts[1:])):
        s, e, v = starts, ends, values
        seq: Sequence[int] = range(n)
    else:
        # Stable sort: equal starts stay oldest-first.
        order = sorted(range(n), key=starts.__getitem__)
        s = array("Q", map(starts.__getitem__, order))
        e = array("Q", map(ends.__getitem__, order))
        v = list(map(values.__getitem__, order))
        seq = order
    if all(map(le, e[:-1], s[1:])):
        return _Layer(s, e, v)
    # Entry j (sorted order) overlaps an earlier one iff its start is below
    # the largest end seen before it; runs of such entries form clusters.
    run_max = array("Q", accumulate(e, max))
    overlapping = list(compress(range(1, n), map(gt, run_max[:-1], s[1:])))
    out = _Layer[T]()
    emitted = 0
    k = 0
    while k < len(overlapping):
        lo = overlapping[k] - 1
        hi = overlapping[k]
        k += 1
        while k < len(overlapping) and overlapping[k] == hi + 1:
            hi += 1
            k += 1
        out.starts.extend(s[emitted:lo])
        out.ends.extend(e[emitted:lo])
        out.values.extend(v[emitted:lo])
        _sweep_cluster(s, e, v, seq, lo, hi + 1, out)
        emitted = hi + 1
    out.starts.extend(s[emitted:])
    out.ends.extend(e[emitted:])
    out.values.extend(v[emitted:])
    out.tombstones = out.values.count(None)
    return out


def _sweep_cluster(
    s: array[int],
    e: array[int],
    v: list[T | None],
    seq: Sequence[int],
    lo: int,
    hi: int,
    out: _Layer[T],
) -> None:
    """Resolve sorted entries ``lo:hi`` that overlap each other: O(m log m).

    Between consecutive boundaries the winner is the newest entry still
    open; a heap keyed on age gives it, with ended entries dropped lazily.
    """
    points = sorted(set(s[lo:hi]).union(e[lo:hi]))
    heap: list[tuple[int, int, int]] = []
    j = lo
    last_idx = -1
    for p, q in pairwise(points):
        while j < hi and s[j] <= p:
            heapq.heappush(heap, (-seq[j], e[j], j))
            j += 1
        while heap and heap[0][1] <= p:
            heapq.heappop(heap)
        if not heap:
            last_idx = -1
            continue
        idx = heap[0][2]
        if idx == last_idx and out.ends[-1] == p:
            out.ends[-1] = q
        else:
            out.starts.append(p)
            out.ends.append(q)
            out.values.append(v[idx])
            last_idx = idx


def _merge(old: _Layer[T], new: _Layer[T]) -> _Layer[T]:
    """Lay ``new`` over ``old``; both resolved, ``new`` wins where they overlap.

    Runs of ``old`` that ``new`` does not touch are copied as slices; only
    the old ranges overlapping a new one are visited one by one.
    """
    if not len(new):
        return old
    if not len(old):
        return new
    os_, oe, ov = old.starts, old.ends, old.values
    ns, ne, nv = new.starts, new.ends, new.values
    rs: array[int] = array("Q")
    re_: array[int] = array("Q")
    rv: list[T | None] = []
    n_old = len(os_)
    i = 0
    cut = -1  # when >= 0: old[i] was trimmed and now starts here
    for k in range(len(ns)):
        a = ns[k]
        b = ne[k]
        j = bisect_right(oe, a, i)  # old[i:j] end at or before a
        if j > i:
            if cut >= 0:
                rs.append(cut)
                re_.append(oe[i])
                rv.append(ov[i])
                i += 1
                cut = -1
            rs.extend(os_[i:j])
            re_.extend(oe[i:j])
            rv.extend(ov[i:j])
            i = j
        while i < n_old:
            s0 = cut if cut >= 0 else os_[i]
            if s0 >= b:
                break
            e0 = oe[i]
            if s0 < a:
                rs.append(s0)
                re_.append(a)
                rv.append(ov[i])
            if e0 > b:
                cut = b
                break
            i += 1
            cut = -1
        rs.append(a)
        re_.append(b)
        rv.append(nv[k])
    if i < n_old:
        if cut >= 0:
            rs.append(cut)
            re_.append(oe[i])
            rv.append(ov[i])
            i += 1
        rs.extend(os_[i:])
        re_.extend(oe[i:])
        rv.extend(ov[i:])
    return _Layer(rs, re_, rv)


class AddrIndex(Generic[T]):
    """Maps addresses to values; for overlapping ranges the newest wins."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget everything (the source file was replaced)."""
        self._base: _Layer[T] = _Layer()
        self._overlay: _Layer[T] = _Layer()
        self._pend_starts: array[int] = array("Q")
        self._pend_ends: array[int] = array("Q")
        self._pend_values: list[T | None] = []
        #: Entries added since the last :meth:`clear` (including tombstones).
        self.added = 0
        # Ranges added since the last take_changes; None: everything changed.
        self._changes: list[tuple[int, int]] | None = None
        self._publish()

    def take_changes(self) -> list[tuple[int, int]] | None:
        """The ``[start, end)`` ranges added since the last call, the only
        places a lookup may answer differently now; None when that is not
        known (the first call, a :meth:`clear`, more than ``MAX_CHANGES``
        ranges): any address may."""
        changes, self._changes = self._changes, []
        return changes

    def _note_changes(self, ranges: Iterable[tuple[int, int]], count: int) -> None:
        changes = self._changes
        if changes is not None:
            if len(changes) + count > MAX_CHANGES:
                self._changes = None
            else:
                changes.extend(ranges)

    def add(self, start: int, end: int, value: T | None) -> bool:
        """Add ``[start, end)``, newer than everything added so far.

        Returns False (and ignores the entry) for an empty or out-of-range
        interval.
        """
        if not 0 <= start < end <= U64_MAX:
            return False
        self._pend_starts.append(start)
        self._pend_ends.append(end)
        self._pend_values.append(value)
        self.added += 1
        self._note_changes(((start, end),), 1)
        return True

    def extend(
        self, starts: array[int], ends: array[int], values: Iterable[T | None]
    ) -> None:
        """Add a batch, oldest first; the caller guarantees ``start < end``."""
        before = len(self._pend_starts)
        self._pend_starts.extend(starts)
        self._pend_ends.extend(ends)
        self._pend_values.extend(values)
        count = len(self._pend_starts) - before
        self.added += count
        self._note_changes(zip(starts, ends, strict=True), count)

    def _flush(self) -> None:
        batch: _Layer[T] = _resolve(self._pend_starts, self._pend_ends, self._pend_values)
        self._pend_starts = array("Q")
        self._pend_ends = array("Q")
        self._pend_values = []
        if not len(self._base) and not len(self._overlay):
            self._base = batch.without_tombstones()
        else:
            if len(batch) <= _SPLICE_MAX:
                overlay = self._overlay
                for k in range(len(batch)):
                    overlay.splice(batch.starts[k], batch.ends[k], batch.values[k])
            else:
                overlay = _merge(self._overlay, batch)
            if len(overlay) > max(_OVERLAY_MIN, len(self._base) // _OVERLAY_FRACTION):
                self._base = _merge(self._base, overlay).without_tombstones()
                self._overlay = _Layer()
            else:
                self._overlay = overlay
        self._publish()

    def _publish(self) -> None:
        """Mirror the layers' arrays into attributes for :meth:`lookup`."""
        self._base_starts = self._base.starts
        self._base_ends = self._base.ends
        self._base_values = self._base.values
        self._overlay_starts = self._overlay.starts
        self._overlay_ends = self._overlay.ends
        self._overlay_values = self._overlay.values

    def lookup(self, addr: int) -> T | None:
        """Value of the newest range containing ``addr``, or None."""
        if self._pend_values:
            self._flush()
        # Hot path: locals and plain attributes only.
        starts = self._overlay_starts
        if starts:
            i = bisect_right(starts, addr) - 1
            if i >= 0 and addr < self._overlay_ends[i]:
                return self._overlay_values[i]
        i = bisect_right(self._base_starts, addr) - 1
        if i >= 0 and addr < self._base_ends[i]:
            return self._base_values[i]
        return None

    def lookup_range(self, addr: int) -> tuple[int, int, T] | None:
        """Like :meth:`lookup` but also returns the resolved ``[start, end)``.

        The range is the part of the entry still visible, which is smaller
        than the entry when newer entries cover some of it.
        """
        if self._pend_values:
            self._flush()
        for layer in (self._overlay, self._base):
            i = layer.find(addr)
            if i >= 0:
                value = layer.values[i]
                if value is None:
                    return None
                return layer.starts[i], layer.ends[i], value
        return None

    def __len__(self) -> int:
        """Resolved ranges held in memory (an overlay range may hide a base one)."""
        if self._pend_values:
            self._flush()
        return len(self._base) + len(self._overlay)

    def items(self) -> list[tuple[int, int, T]]:
        """All visible ranges in address order (for tests and debugging)."""
        if self._pend_values:
            self._flush()
        merged = _merge(self._base, self._overlay)
        return [
            (s, e, v)
            for s, e, v in zip(merged.starts, merged.ends, merged.values, strict=True)
            if v is not None
        ]


__all__ = ["U64_MAX", "AddrIndex"]
