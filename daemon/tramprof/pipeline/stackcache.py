"""Named stacks of the last drains, found again by the kernel's identity of
their raw stacks.

A busy node samples mostly the stacks it sampled in the drain before: the
same process image, user stack (the kernel stores each once, under two
independent 64-bit hashes) and kernel stack. Naming such a stack frame by
frame again (merging its trampoline frames, a cache lookup per frame) costs
far more than one dictionary lookup of the whole stack.

A named stack is kept only when the process image's caches alone named it
(a frame looked up past them may be named otherwise next time, and its
lookup is what re-reads JIT files), and is found only while the image's
caches stay valid (``ProcessImage.naming_state`` is part of the key) and its
trampoline stubs are where they were. What naming it counted (JIT cache
hits, kernel frames without a symbol) is counted again at each reuse, so
counters do not depend on this cache. Stacks not found in the drain before
last are forgotten: the cache holds about two drains' distinct stacks.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from tramprof.model import FrameSource, RawSample
from tramprof.unwind.arenas import Arenas

#: Named stacks kept per drain (generation), over all processes: ~300 bytes
#: each besides the frames, which the windows kept for ``/profile`` share.
MAX_STACKS = 1 << 14

# (pid, start time, exec id) of a process image, and where its stubs are.
ImageKey = tuple[tuple[int, int, int], Arenas | None]


@dataclass(slots=True)
class NamedStack:
    """One raw stack's frames, root first, as ``pipeline.frames`` named them."""

    frames: tuple[str, ...]
    sources: tuple[FrameSource | None, ...]
    jit_hits: int  # frames the image's JIT caches named
    kernel_misses: int  # kernel frames without a symbol


def stack_key(sample: RawSample, naming_state: Hashable) -> Hashable | None:
    """What names ``sample`` within one process image: None when the kernel
    gave no identity for its user stack."""
    if sample.user_stack_id == (0, 0):
        return None
    return (naming_state, sample.user_stack_id, sample.user_flags, sample.kernel_ips,
            sample.kernel_error)


class ImageStacks:
    """The named stacks of one process image: this drain's, then the last."""

    __slots__ = ("_cache", "_current", "_previous")

    def __init__(self, cache: StackCache, current: dict[Hashable, NamedStack],
                 previous: dict[Hashable, NamedStack] | None) -> None:
        self._cache = cache
        self._current = current
        self._previous = previous

    def get(self, key: Hashable) -> NamedStack | None:
        found = self._current.get(key)
        if found is None and self._previous is not None:
            found = self._previous.get(key)
            if found is not None:
                self._cache.keep(self._current, key, found)
        return found

    def put(self, key: Hashable, stack: NamedStack) -> None:
        self._cache.keep(self._current, key, stack)


class StackCache:
    """Named stacks of this drain and the last, per process image."""

    def __init__(self, max_stacks: int = MAX_STACKS) -> None:
        self._max = max_stacks
        self._current: dict[ImageKey, dict[Hashable, NamedStack]] = {}
        self._previous: dict[ImageKey, dict[Hashable, NamedStack]] = {}
        self._kept = 0
        self.reused = 0  # stacks found here (cumulative)
        self.named = 0  # stacks named frame by frame (cumulative)

    def image(self, image: tuple[int, int, int], stubs: Arenas | None) -> ImageStacks:
        key = (image, stubs)
        current = self._current.get(key)
        if current is None:
            current = self._current[key] = {}
        return ImageStacks(self, current, self._previous.get(key))

    def keep(self, stacks: dict[Hashable, NamedStack], key: Hashable,
             stack: NamedStack) -> None:
        """Add to this drain's stacks while they stay within the bound."""
        if self._kept < self._max:
            stacks[key] = stack
            self._kept += 1

    def end_drain(self) -> None:
        """This drain's stacks become the last drain's; older ones go."""
        self._previous = {key: stacks for key, stacks in self._current.items() if stacks}
        self._current = {}
        self._kept = 0

    def __len__(self) -> int:
        return self._kept
