"""Profiling a process until its unwind tables are loaded, then measuring:
shared by the BPF and trampoline tiers."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler
from tramprof.pipeline.stats import ProfilerStats
from tramprof.unwind.tables import TableMode

Stacks = Counter[tuple[str, ...]]


def is_start(frame: str) -> bool:
    """What stands above main(): _start and libc's start-up code, named from
    libc's symbols (or separate debug file), else as libc.so.6+0xOFFSET."""
    return frame == "_start" or frame.startswith(("__libc_start", "libc.so.6+0x"))


def rooted(frames: tuple[str, ...], chain: list[str]) -> bool:
    """The whole stack: _start, libc's start-up frames, then exactly ``chain``."""
    if "main" not in frames:
        return False
    at = frames.index("main")
    return (list(frames[at:]) == chain and at >= 1 and frames[0] == "_start"
            and all(is_start(f) for f in frames[:at]))


def share(stacks: Stacks, good: Callable[[tuple[str, ...]], bool]) -> float:
    total = sum(stacks.values())
    return sum(c for s, c in stacks.items() if good(s)) / total if total else 0.0


def profile(pid: int, good: Callable[[tuple[str, ...]], bool], seconds: float = 3.0,
            warm_timeout: float = 90.0) -> tuple[Stacks, ProfilerStats, TableMode]:
    """Profile ``pid`` until its tables are in (a drain is mostly ``good`` and
    no table of an object seen so far is still being built, or the time is
    up), then for ``seconds`` more: those stacks are returned. (A rarely
    sampled object, such as libstdc++ under a C++ throw, may be seen only
    after the drain that is mostly good; its frames are leaf-only until its
    table is in.)"""
    profiler = Profiler(Config(pids=(pid,), frequency=499, interval=0.5))
    profiler.start()
    try:
        mode = next(m for m in profiler.unwinders.native if isinstance(m, TableMode))
        deadline = time.monotonic() + warm_timeout
        while time.monotonic() < deadline:
            profiler.wait(0.5)
            drained: Stacks = Counter()
            for stack in profiler.collect():
                drained[stack.frames] += stack.count
            building = any(o.state == "queued" for o in mode.objects())
            if sum(drained.values()) >= 50 and share(drained, good) >= 0.9 and not building:
                break
        stacks: Stacks = Counter()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            profiler.wait(0.5)
            for stack in profiler.collect():
                stacks[stack.frames] += stack.count
        return stacks, profiler.stats.copy(), mode
    finally:
        profiler.close()


def top(stacks: Stacks) -> list[tuple[tuple[str, ...], int]]:
    return stacks.most_common(4)
