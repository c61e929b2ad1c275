"""Names one drain's raw samples as stacks of their process images.

Samples come sorted by process image, so each image is looked up once per
drain. A raw stack named in one of the last drains is found again whole
(``pipeline.stackcache``); the rest are named by one compiled pass over the
whole stack where the image's caches and the names other processes found
name every frame, else frame by frame (``pipeline.frames``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tramprof.model import FrameSource, RawSample, Stack
from tramprof.pipeline.frames import KernelResolver, cached_frames, kernel_part, named_frames
from tramprof.pipeline.stackcache import ImageStacks, NamedStack, StackCache, stack_key
from tramprof.symbols.images import ProcessImage
from tramprof.unwind.arenas import Arenas

# (pid, start time, exec id) of a process image.
ImageKey = tuple[int, int, int]


class ImageSource(Protocol):
    """Where process images are found (``symbols.images.ProcessRegistry``)."""

    def image(self, tgid: int, start_boottime_ns: int, exec_id: int,
              fallback_name: str) -> tuple[str, ProcessImage | None]:
        """Process name and image; no image when the process is gone."""


@dataclass(slots=True)
class _Naming:
    """How the samples of one process image are named in this drain."""

    key: ImageKey
    process: str  # the process's name
    image: ProcessImage | None  # None: its state is gone
    stubs: Arenas | None
    stacks: ImageStacks | None  # its stacks named in the last drains


class CountingNamer:
    """``ProcessImage.name_frames`` that keeps whether the image's caches
    alone named the stack (``jit_hits`` then: else None)."""

    __slots__ = ("image", "jit_hits")

    def __init__(self, image: ProcessImage) -> None:
        self.image = image
        self.jit_hits: int | None = None

    def __call__(self, addresses: Sequence[int | str]
                 ) -> tuple[Sequence[str], Sequence[FrameSource | None]]:
        names, sources, self.jit_hits = self.image.name_frames_cached(addresses)
        return names, sources


class StackNamer:
    """Names samples (``name``), one drain at a time (``end_drain``).

    ``failures`` counts what could not be named, by reason; a stack found
    again counts what naming it counted."""

    def __init__(self, images: ImageSource, arenas: Callable[[int], Arenas | None],
                 kernel: KernelResolver, failures: Counter[str],
                 cache: StackCache | None = None) -> None:
        self._images = images
        self._arenas = arenas
        self._kernel = kernel
        self._failures = failures
        self.cache = StackCache() if cache is None else cache
        self._naming: _Naming | None = None
        # pid -> the newest of its images named in this drain.
        self._sampled: dict[int, tuple[ImageKey, ProcessImage]] = {}

    def name(self, sample: RawSample) -> Stack:
        """The sample as a named stack of its process."""
        if not sample.user_ips:
            frames, sources = named_frames(sample, None, self._kernel, self._failures)
            return Stack(pid=sample.tgid, process=sample.comm, comm=sample.comm,
                         frames=frames, count=sample.count, sources=sources)
        key = (sample.tgid, sample.start_boottime_ns, sample.exec_id)
        naming = self._naming
        if naming is None or naming.key != key:
            naming = self._naming = self._naming_for(sample, key)
        named = self._named(sample, naming)
        return Stack(pid=sample.tgid, process=naming.process, comm=sample.comm,
                     frames=named.frames, count=sample.count, sources=named.sources)

    def end_drain(self) -> list[tuple[ImageKey, ProcessImage]]:
        """The drain's samples are named: the newest image of each process
        they were named with (samples from before an exec are named with the
        image they ran in)."""
        self._naming = None
        self.cache.end_drain()
        sampled, self._sampled = self._sampled, {}
        return list(sampled.values())

    def _naming_for(self, sample: RawSample, key: ImageKey) -> _Naming:
        process, found = self._images.image(sample.tgid, sample.start_boottime_ns,
                                            sample.exec_id, sample.comm)
        stubs = self._arenas(sample.tgid)
        if found is not None and found.symbolizer is not None and \
                found.symbolizer.exited_unread():
            # Seen alive, gone (or its memory released) before its maps were
            # read: one marker, not a column of [unknown] frames.
            self._failures["process_exited"] += 1
            found = None
        if found is None:
            return _Naming(key, process, None, stubs, None)
        newest = self._sampled.get(sample.tgid)
        if newest is None or key[1:] > newest[0][1:]:
            self._sampled[sample.tgid] = (key, found)
        return _Naming(key, process, found, stubs, self.cache.image(key, stubs))

    def _named(self, sample: RawSample, naming: _Naming) -> NamedStack:
        """Found again for the same raw stack of this image, or named now."""
        image, failures, stacks = naming.image, self._failures, naming.stacks
        key = None
        if image is not None and stacks is not None:
            key = stack_key(sample, image.naming_state())
            if key is not None:
                found = stacks.get(key)
                if found is not None:
                    self.cache.reused += 1
                    image.count_jit_hits(found.jit_hits)
                    if found.kernel_misses:
                        failures["kernel_no_symbol"] += found.kernel_misses
                    return found
        self.cache.named += 1
        misses = failures["kernel_no_symbol"]
        kernel_frames = kernel_part(sample, self._kernel, failures)
        kernel_misses = failures["kernel_no_symbol"] - misses
        addresses = None
        if image is not None:
            cached = cached_frames(sample, image.caches(), naming.stubs, kernel_frames)
            if isinstance(cached, tuple):
                frames, sources, jit_hits, shared_hits = cached
                image.count_jit_hits(jit_hits)
                named = NamedStack(frames, sources, jit_hits, kernel_misses)
                # As name_frames_cached keeps it: names found past the
                # image's own caches are found there next time.
                if key is not None and stacks is not None and not shared_hits:
                    stacks.put(key, named)
                return named
            addresses = cached
        namer = None if image is None else CountingNamer(image)
        frames, sources = named_frames(sample, namer, self._kernel, failures, naming.stubs,
                                       addresses, kernel_frames)
        cached_hits = None if namer is None else namer.jit_hits
        named = NamedStack(frames, sources, cached_hits or 0, kernel_misses)
        if key is not None and stacks is not None and cached_hits is not None:
            stacks.put(key, named)
        return named
