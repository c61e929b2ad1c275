"""Names the frames of one raw sample, root first.

User frames come before kernel frames of the same sample, as flame graphs
draw them. Cut or lost parts of a stack are shown as one bracketed marker
frame, never as made-up names. ``located_frames`` also gives where each
frame's code is (address, mapping), for formats that keep addresses.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from functools import lru_cache, partial

from tramprof.model import (
    KERNEL_LOST,
    PROCESS_EXITED,
    TRUNCATED,
    UNKNOWN_KERNEL,
    FrameSource,
    MappedFile,
    RawSample,
)
from tramprof.sampler import layout
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.merge import is_truncated, user_addresses

# address -> name; the user resolver belongs to one process image.
UserResolver = Callable[[int], str]
KernelResolver = Callable[[int], str | None]
# address -> where its code is; the user locator belongs to one process image.
UserLocator = Callable[[int], FrameSource | None]
# Leaf-first lookup addresses of one stack (markers are strings) -> their
# names and where their code is, in the same order; belongs to one process
# image (``ProcessImage.name_frames``).
UserNamer = Callable[[Sequence[int | str]],
                     tuple[Sequence[str], Sequence[FrameSource | None]]]
Sources = tuple[FrameSource | None, ...]

#: The kernel's text as one mapping, named as perf and pprof name it (tools
#: skip bracketed names when they look for binaries).
KERNEL_MAPPING = MappedFile("[kernel.kallsyms]", 0xFFFF_8000_0000_0000, 0xFFFF_FFFF_FFFF_FFFF, 0)


@lru_cache(maxsize=1 << 16)
def _kernel_source(address: int) -> FrameSource:
    # One object per address: stored windows share them instead of holding
    # a copy per sample.
    return FrameSource(address, KERNEL_MAPPING)


def _one_by_one(resolve: UserResolver, locate: UserLocator | None,
                addresses: Sequence[int | str]
                ) -> tuple[list[str], list[FrameSource | None]]:
    """A ``UserNamer`` from an address resolver and locator."""
    names = [a if isinstance(a, str) else resolve(a) for a in addresses]
    sources = [None if isinstance(a, str) or locate is None else locate(a) for a in addresses]
    return names, sources


def symbolize_kernel(ips: tuple[int, ...], resolve: KernelResolver,
                     failures: Counter[str]) -> list[str]:
    names = []
    for index, ip in enumerate(ips):
        name = resolve(ip if index == 0 else ip - 1)
        if name is None:
            failures["kernel_no_symbol"] += 1
            name = UNKNOWN_KERNEL
        names.append(name)
    names.reverse()
    return names


def stack_frames(sample: RawSample, user: UserResolver | None, kernel: KernelResolver,
                 failures: Counter[str], stubs: Arenas | None = None) -> tuple[str, ...]:
    """All frames of one sample, root first."""
    return located_frames(sample, user, None, kernel, failures, stubs)[0]


def located_frames(sample: RawSample, user: UserResolver | None,
                   locate: UserLocator | None, kernel: KernelResolver,
                   failures: Counter[str], stubs: Arenas | None = None,
                   ) -> tuple[tuple[str, ...], Sources]:
    """``stack_frames`` and, parallel to them, where each frame's code is
    (None for markers and where ``locate`` knows nothing)."""
    namer = None if user is None else partial(_one_by_one, user, locate)
    return named_frames(sample, namer, kernel, failures, stubs)


def named_frames(sample: RawSample, user: UserNamer | None, kernel: KernelResolver,
                 failures: Counter[str], stubs: Arenas | None = None,
                 ) -> tuple[tuple[str, ...], Sources]:
    """``located_frames`` with the user frames named by a whole stack at once."""
    frames: list[str] = []
    sources: list[FrameSource | None] = []
    if not sample.user_flags & layout.USTACK_NO_USER:
        if is_truncated(sample):
            frames.append(TRUNCATED)
            sources.append(None)
        if user is None:
            frames.append(PROCESS_EXITED)
            sources.append(None)
        else:
            names, where = user(user_addresses(sample, stubs))
            frames.extend(reversed(names))
            sources.extend(reversed(where))
    ips = sample.kernel_ips
    if ips:
        frames.extend(symbolize_kernel(ips, kernel, failures))
        # Looked up as symbolize_kernel does: callers one byte back.
        kernel_sources = [_kernel_source(ip - 1) for ip in ips[:0:-1]]
        kernel_sources.append(_kernel_source(ips[0]))
        sources.extend(kernel_sources)
    if sample.kernel_error:
        frames.append(KERNEL_LOST)
        sources.append(None)
    return tuple(frames), tuple(sources)
