"""The types every stage shares: sample -> unwind -> symbolize -> aggregate ->
export hand these to each other, so they live in one leaf module that imports
nothing of tramprof's (the layers contract in ``pyproject.toml`` keeps it so).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

# Marker frames. Cut or lost parts of a stack are shown as one bracketed
# frame, never as made-up names; every writer (metrics, folded, pprof, flame
# graph) shows them as they are.
TRUNCATED = "[truncated]"
# Native frames between the last one the frame-pointer walk reached and the
# trampoline frames above it could not be unwound (code without frame pointers).
NATIVE_GAP = "[native frames not unwound]"
# The process's trampoline runtime was paused by its overhead budget when
# the sample was taken: native frames only, no Python names (at the root, so
# paused samples stay together in a flame graph).
PYTHON_PAUSED = "[python frames paused]"
KERNEL_LOST = "[kernel stack lost]"
PROCESS_EXITED = "[process exited]"
UNKNOWN_KERNEL = "[unknown kernel]"


class SymbolizationError(Exception):
    """Base class of every failure to read or name what a process exposes
    (its maps, binaries, JIT files), so callers that only want "degrade the
    frame" catch one type while subclasses carry the counted reason."""


class ProcessGone(SymbolizationError):
    """The process exited (or became a zombie) before we could read it.

    Short-lived processes are the normal case for a fleet profiler, so this is
    an expected condition that callers count rather than log.
    """

    def __init__(self, pid: int, detail: str = "") -> None:
        self.pid = pid
        message = f"process {pid} is gone"
        super().__init__(f"{message}: {detail}" if detail else message)


@dataclass(slots=True)
class RawSample:
    """One unique (process, thread name, kernel stack, user stack) and its
    count, as drained from the kernel: addresses, not names. Not frozen: a
    drain makes thousands, and a frozen dataclass takes ten times as long to
    build (each field set through ``object.__setattr__``); nothing changes
    one after the drain."""

    tgid: int
    start_boottime_ns: int
    exec_id: int
    comm: str
    # The native frames, leaf first: each one's ip and, at the same index,
    # its stack address. Two flat tuples, not a pair a frame: made and freed
    # again at every drain, a 60-frame stack cost 9 us as pairs, 3 us so.
    user_ips: tuple[int, ...]
    user_sps: tuple[int, ...]
    user_flags: int  # USTACK_* / CHAIN_* / SCAN_* bits of sampler.layout
    kernel_ips: tuple[int, ...]  # leaf first
    # Trampoline frames recovered by a chain walk or a stack scan, innermost
    # first: (stub address, stack address). Empty in plain fp mode.
    trampoline_frames: tuple[tuple[int, int], ...]
    kernel_error: int  # 0, or -errno when the kernel part was lost
    count: int
    # The kernel's identity of the user stack: its two independent 64-bit
    # hashes (over return addresses and trampoline frames), by which it
    # stored the stack once for every sample that has it. The same in every
    # drain for the same stack of a process image; (0, 0) when unknown.
    user_stack_id: tuple[int, int] = (0, 0)


class MappedFile(NamedTuple):
    """The mapped file (or kernel image) a frame's code lies in: what pprof's
    Mapping holds, so tools can find the binary again (by path or build id)
    and turn an address into a file offset."""

    path: str  # as the process sees it; bracketed for [kernel.kallsyms], [vdso]
    start: int
    end: int  # exclusive
    file_offset: int
    build_id: str = ""  # hex GNU build id, "" when unknown


class FrameSource(NamedTuple):
    """Where one frame's code is: its lookup address in the process (a return
    address minus one for callers, as the name was found), its mapping, and
    its source file and line when known (e.g. from a jitdump's debug info)."""

    address: int
    mapping: MappedFile | None = None
    file: str = ""
    line: int = 0


@dataclass(frozen=True)
class Stack:
    """A symbolized, aggregated stack of one process."""

    pid: int
    process: str  # the process's name (its main thread's comm)
    comm: str  # the sampled thread's name
    frames: tuple[str, ...]  # root first
    count: int
    # Parallel to ``frames`` (None for marker frames), or empty when not
    # known. Only formats that keep addresses (pprof) read it.
    sources: tuple[FrameSource | None, ...] = field(default=(), compare=False)

    def folded_key(self) -> tuple[str, ...]:
        return (self.comm, *self.frames)


@dataclass(frozen=True)
class Profile:
    """Stacks sampled between ``start_ns`` and ``start_ns + duration_ns``
    (CLOCK_REALTIME, ns); each sample stands for 1/``frequency_hz`` s of CPU.
    The input of every writer (folded, pprof, speedscope, flame graph)."""

    stacks: tuple[Stack, ...]
    start_ns: int
    duration_ns: int
    frequency_hz: int
    # Extra labels per pid for formats that carry them (pprof): container_id,
    # pod_uid. Only non-empty values.
    process_labels: Mapping[int, Mapping[str, str]] = field(default_factory=dict,
                                                              compare=False)

    @property
    def period_ns(self) -> int:
        return 1_000_000_000 // self.frequency_hz

    @property
    def total_samples(self) -> int:
        return sum(s.count for s in self.stacks)

    def only_pids(self, pids: set[int]) -> Profile:
        return Profile(tuple(s for s in self.stacks if s.pid in pids), self.start_ns,
                       self.duration_ns, self.frequency_hz,
                       {pid: labels for pid, labels in self.process_labels.items()
                        if pid in pids})


def merge(profiles: list[Profile], frequency_hz: int) -> Profile:
    """One profile covering all of ``profiles`` with identical stacks (same
    frames at the same addresses) summed."""
    if not profiles:
        return Profile((), 0, 0, frequency_hz)
    counts: Counter[tuple[int, str, str, tuple[str, ...],
                          tuple[FrameSource | None, ...]]] = Counter()
    labels: dict[int, Mapping[str, str]] = {}
    for profile in profiles:
        for s in profile.stacks:
            counts[(s.pid, s.process, s.comm, s.frames, s.sources)] += s.count
        labels.update(profile.process_labels)
    start = min(p.start_ns for p in profiles)
    end = max(p.start_ns + p.duration_ns for p in profiles)
    stacks = tuple(Stack(pid=pid, process=process, comm=comm, frames=frames, count=count,
                         sources=sources)
                   for (pid, process, comm, frames, sources), count in counts.items())
    return Profile(stacks, start, end - start, frequency_hz, labels)
