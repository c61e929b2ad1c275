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

from tramprof import speedups
from tramprof.model import (
    KERNEL_LOST,
    NATIVE_GAP,
    PROCESS_EXITED,
    TRUNCATED,
    UNKNOWN_KERNEL,
    FrameSource,
    MappedFile,
    RawSample,
)
from tramprof.sampler import layout
from tramprof.symbols.images import SharedPass
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.merge import is_truncated, merge_arguments, user_addresses

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
                 addresses: list[int | str] | None = None,
                 kernel_frames: tuple[tuple[str, ...], Sources] | None = None,
                 ) -> tuple[tuple[str, ...], Sources]:
    """``located_frames`` with the user frames named by a whole stack at once.
    ``addresses`` (``user_addresses``) and ``kernel_frames``
    (``kernel_part``), when given, are those worked out already."""
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
            names, where = user(user_addresses(sample, stubs) if addresses is None
                                else addresses)
            frames.extend(reversed(names))
            sources.extend(reversed(where))
    kernel_names, kernel_sources = kernel_part(sample, kernel, failures) \
        if kernel_frames is None else kernel_frames
    frames.extend(kernel_names)
    sources.extend(kernel_sources)
    return tuple(frames), tuple(sources)


def kernel_part(sample: RawSample, kernel: KernelResolver, failures: Counter[str]
                ) -> tuple[tuple[str, ...], Sources]:
    """The kernel frames of a sample, root first, and where their code is;
    a lost kernel part ends in one marker."""
    ips = sample.kernel_ips
    if not ips and not sample.kernel_error:
        return (), ()
    frames = symbolize_kernel(ips, kernel, failures) if ips else []
    # Looked up as symbolize_kernel does: callers one byte back.
    sources: list[FrameSource | None] = [_kernel_source(ip - 1) for ip in ips[:0:-1]]
    if ips:
        sources.append(_kernel_source(ips[0]))
    if sample.kernel_error:
        frames.append(KERNEL_LOST)
        sources.append(None)
    return tuple(frames), tuple(sources)


# Frames, places, and how many frames the JIT cache and the names other
# processes found named, of a stack named without lookups.
CachedFrames = tuple[tuple[str, ...], Sources, int, int]


def cached_frames(sample: RawSample, caches: tuple[dict[int, tuple[str, FrameSource]],
                                                   dict[int, tuple[str, FrameSource]],
                                                   SharedPass | None],
                  stubs: Arenas | None, kernel_frames: tuple[tuple[str, ...], Sources]
                  ) -> CachedFrames | list[int | str] | None:
    """``named_frames`` of a sample whose user frames its process image's
    caches (``ProcessImage.caches``) name, or the names other processes
    found, in one compiled call. When one is left: its lookup addresses
    (name it with ``named_frames``, which takes them); None when the
    compiled pass does not take the sample (``named_frames`` alone)."""
    compiled = speedups.compiled
    if compiled is None or sample.user_flags & layout.USTACK_NO_USER:
        return None
    arguments = merge_arguments(sample, stubs)
    if arguments is None:
        return None
    head = _TRUNCATED if is_truncated(sample) else ()
    return compiled.cached_stack(*arguments, NATIVE_GAP, *caches, head, *kernel_frames)


_TRUNCATED = (TRUNCATED,)
