"""Merges the native frames of a sample with its trampoline frames.

Every recovered frame carries its stack address, so native frames of the
frame-pointer walk and trampoline frames of the chain walk or the stack scan
interleave in true call order. Return addresses are looked up one byte back
(into the call instruction) so that a call at the very end of a function
names the caller; trampoline frames are stub starts, looked up as they are.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Iterable
from operator import itemgetter, le
from typing import cast

from tramprof import speedups
from tramprof.model import NATIVE_GAP, PYTHON_PAUSED, RawSample
from tramprof.sampler import layout
from tramprof.unwind.arenas import Arenas

_INCOMPLETE = layout.TABLE_STOP | layout.USTACK_FAULT


# What the compiled merge takes: native ips and stack addresses, trampoline
# frames, the stub arenas' starts and ends, whether the native walk stopped
# short, and whether a gap marker ends the stack (a table walk's stop).
MergeArguments = tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, int], ...],
                       list[int], list[int], bool, bool]


def merge_arguments(sample: RawSample, stubs: Arenas | None) -> MergeArguments | None:
    """The compiled merge's arguments for ``sample``; None when it does not
    take it (a sample taken with the hook off: ``merged_user_addresses``)."""
    flags = sample.user_flags
    if flags & layout.PYTHON_PAUSED:
        return None
    if sample.trampoline_frames and stubs is not None:
        starts, ends = stubs.search_lists
        return (sample.user_ips, sample.user_sps, sample.trampoline_frames, starts, ends,
                bool(flags & _INCOMPLETE), False)
    return (sample.user_ips, sample.user_sps, (), [], [], False,
            bool(flags & layout.TABLE_STOP))


def user_addresses(sample: RawSample, stubs: Arenas | None) -> list[int | str]:
    """``merged_user_addresses``, by the compiled pass where it takes the
    sample (nearly always: see ``_speedups.c``)."""
    compiled = speedups.compiled
    arguments = None if compiled is None else merge_arguments(sample, stubs)
    if arguments is None:
        return merged_user_addresses(sample, stubs)
    ips, sps, tramps, starts, ends, incomplete, stop_gap = arguments
    merged = compiled.merge_trampolines(ips, sps, tramps, starts, ends, incomplete, NATIVE_GAP)
    if merged is None:
        return merged_user_addresses(sample, stubs)
    if stop_gap:
        merged.append(NATIVE_GAP)
    return merged


def merged_user_addresses(sample: RawSample, stubs: Arenas | None) -> list[int | str]:
    """Lookup addresses of the user stack, leaf first, with the trampoline
    frames merged in by stack address (markers as strings).

    A stub's own native frame is dropped: its trampoline frame, named from
    the perf map, stands in. Where the native walk stopped below trampoline
    frames, or the table walk stopped at code without unwind rules, one
    ``NATIVE_GAP`` marker says native frames are missing. A sample taken while
    the runtime's duty cycle had its hook off ends in ``PYTHON_PAUSED``.
    """
    ips = sample.user_ips
    pcs = [ip - 1 for ip in ips]
    if ips:
        pcs[0] = ips[0]  # the leaf's pc is not a return address
    lookups = cast(list[int | str], pcs)
    stopped = bool(sample.user_flags & layout.TABLE_STOP)
    if sample.user_flags & layout.PYTHON_PAUSED:
        # Stubs still on the stack would name some Python frames and not
        # others: none are named, one marker says why.
        kept = lookups if stubs is None else [a for a in lookups if a not in stubs]
        return kept + ([NATIVE_GAP] if stopped else []) + [PYTHON_PAUSED]
    if not sample.trampoline_frames or stubs is None:
        # The table walk stopped at code it has no rule for: say so at the root.
        return [*lookups, NATIVE_GAP] if stopped else lookups
    low, high = stubs.bounds
    # Native frames keep the walker's order, leaf first: it gives them by
    # stack address, except that a frameless leaf's caller is ordered 8
    # bytes below the sampled sp (the table walk orders a caller by its
    # return address's slot - 8). Sorting them would swap the two.
    native = [(sp, addr) for sp, addr in zip(sample.user_sps, pcs, strict=True)
              if not low <= addr < high or addr not in stubs]
    reached = native[-1][0] if native else 0
    incomplete = stopped or bool(sample.user_flags & layout.USTACK_FAULT)
    # Trampoline frames in stack order, each merged in before the first
    # native frame above it (native first on equal stack addresses).
    tramps = sorted(((sp, ip) for ip, sp in sample.trampoline_frames), key=_STACK_ADDRESS)
    native_sps = [sp for sp, _addr in native]
    if all(map(le, native_sps, native_sps[1:])):
        # Nearly always: a stable sort is then the same merge, at C speed.
        merged: Iterable[tuple[int, int]] = sorted(native + tramps, key=_STACK_ADDRESS)
    else:
        merged = heapq.merge(native, tramps, key=_STACK_ADDRESS)
    above = bisect.bisect_right(tramps, reached, key=_STACK_ADDRESS)
    if not (incomplete and native) or above == len(tramps):
        return list(map(_ADDRESS, merged))
    # The native walk stopped: the marker goes before the first trampoline
    # frame above its last frame.
    gap_before = tramps[above]
    out: list[int | str] = []
    for frame in merged:
        if frame is gap_before:
            out.append(NATIVE_GAP)
        out.append(frame[1])
    return out


_STACK_ADDRESS = itemgetter(0)
_ADDRESS = itemgetter(1)


def is_truncated(sample: RawSample) -> bool:
    """Frames are missing at the root end: a walker ran out of room or window."""
    flags = sample.user_flags
    return bool(flags & (layout.CHAIN_TRUNCATED | layout.SCAN_TRUNCATED | layout.SCAN_OVERFLOW)
                or (flags & layout.USTACK_TRUNCATED and not sample.trampoline_frames))
