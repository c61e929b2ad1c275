"""What the daemon remembers per process: its name and symbolizers.

State is keyed by (pid, start time), so a reused pid never sees the symbols
of the process that had it before, and within one process by exec id (the
kernel's ``self_exec_id``, carried by every sample), so samples taken before
an exec are never named with the new image's symbols.

Lifecycle events are applied one drain late: samples of a process that just
exited are still in the kernel buffer and need its state once more.
"""

from __future__ import annotations

import functools
import logging
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from operator import attrgetter
from typing import TypeVar, cast

from tramprof import speedups
from tramprof.model import FrameSource, MappedFile, ProcessGone, SymbolizationError
from tramprof.procfs.events import ProcessEvent
from tramprof.procfs.identity import ProcessIdentity, ProcStat, boottime_ns_to_ticks
from tramprof.procfs.maps import Mapping
from tramprof.procfs.metadata import ProcessMetadata, read_metadata
from tramprof.procfs.table import ProcessTable
from tramprof.symbols.debuginfo import DebugInfo, DebugTable
from tramprof.symbols.demangle import Demangler
from tramprof.symbols.elf import ElfCache
from tramprof.symbols.horizon import SampleHorizon
from tramprof.symbols.jit import GAUGES, JitLimits, JitSymbols
from tramprof.symbols.usersyms import (
    ANON,
    UNKNOWN,
    KernelVdso,
    ProcessSymbolizer,
    SymbolizationStats,
    read_kernel_vdso,
)

log = logging.getLogger(__name__)

# Distinct addresses remembered per process image; bounds memory for
# processes with huge, ever-changing JIT code.
MAX_CACHED_ADDRESSES = 65536
#: Memory of one cached address, as ``address_cache_bytes`` counts it: its
#: key, dictionary slot, answer and place (measured on file code; a test
#: keeps it true); names and mapped files are shared.
CACHED_ADDRESS_BYTES = 224
# Exec generations kept per process (a process that execs in a loop).
MAX_IMAGES = 2


_Value = TypeVar("_Value")
# A cached answer for one address: its name, and where its code is.
_Answer = tuple[str, FrameSource]
# One frame as named: a marker or an address outside code has no place.
_Named = tuple[str, FrameSource | None]
#: What the compiled shared-name pass takes besides a stack and its answers:
#: segment starts and ends, each segment's (key, bias, mapped file), the
#: names found by any process, the cache's bound, and how a place is made.
SharedPass = tuple[list[int], list[int], list[tuple[str, int, MappedFile]],
                   dict[tuple[str, int], str], int, type[FrameSource]]


def forget_in_ranges(cache: dict[int, _Value], ranges: Sequence[tuple[int, int]]) -> bool:
    """Drop the cached addresses inside any ``[start, end)`` of ``ranges``;
    True when some were. One sort of the cache and two bisections a range,
    not a test of every address against every range."""
    if not cache or not ranges:
        return False
    addresses = sorted(cache)
    dropped = False
    for start, end in ranges:
        for addr in addresses[bisect_left(addresses, start):bisect_left(addresses, end)]:
            dropped = cache.pop(addr, None) is not None or dropped
    return dropped


def _remember(cache: dict[int, _Value], addr: int, value: _Value) -> bool:
    """Cache ``value`` at ``addr``; a full cache is emptied first (False)."""
    kept = len(cache) < MAX_CACHED_ADDRESSES
    if not kept:
        cache.clear()
    cache[addr] = value
    return kept


@dataclass
class ProcessImage:
    """One executable image of a process: its symbolizers and address caches.

    Names and locations from files are cached until an executable file
    mapping goes away (an address may then hold other code:
    ``files_generation``); addresses in mappings without code are not
    cached. JIT code is re-created at reused addresses, so what is found in
    anonymous memory is cached only until the process's JIT files are
    replaced or its executable mappings change (``_jit_key``), and at an
    address in the range of an entry the files gained since (``JitSymbols.changes``):
    until then the same lookup gives the same answer (new code at an
    address comes with a new entry over it, or with a new mapping), and a
    Python process under the runtime asks for the same few hundred stub
    addresses in every stack of a drain. A re-read that finds nothing new,
    entries elsewhere (a node process appends some all the time), and data
    mappings that come and go (heaps, a Python's memory arenas), keep the
    cache.
    """

    symbolizer: ProcessSymbolizer | None
    jit: JitSymbols | None = None
    # Address -> (name, where its code is): file-backed code in ``found``,
    # named JIT code in ``jit_found``. Pairs, not a dictionary each: a stack
    # is named with one lookup a frame in each. A place is one object per
    # address, shared by every stored sample that has it.
    found: dict[int, _Answer] = field(default_factory=dict)
    jit_found: dict[int, _Answer] = field(default_factory=dict)
    # Where unnamed JIT code is: kept for the same sharing, not an answer
    # (an unnamed address is looked up again: its name may come).
    jit_places: dict[int, FrameSource] = field(default_factory=dict)
    _jit_key: tuple[int, int] = (-1, -1)  # (JIT epoch, code generation) of the jit_ caches
    _jit_answers: int = 0  # moves when JIT answers were forgotten in part
    _files_key: int = 0  # the symbolizer's files_generation of ``found``
    mapped_files: dict[Mapping, MappedFile] = field(default_factory=dict)
    #: When a drain last named stacks with this image (monotonic seconds).
    last_used: float = 0.0
    # The symbolizer's direct segments as the compiled shared-name pass
    # takes them, for its direct_generation (None: to be made again).
    _shared_segments: _SharedSegments | None = None

    def cached_addresses(self) -> int:
        """Addresses whose names and places are cached."""
        return len(self.found) + len(self.jit_found) + len(self.jit_places)

    def forget_addresses(self) -> None:
        """Empty the address caches (they fill again as stacks are named)."""
        self.found.clear()
        self.jit_found.clear()
        self.jit_places.clear()
        self._forget_mapped_files()

    def _forget_mapped_files(self) -> None:
        """Forget the mappings' files (and what shares them: the segments)."""
        self.mapped_files.clear()
        self._shared_segments = None

    def _validate_caches(self) -> ProcessSymbolizer | None:
        """Empty the caches whose answers may be void now; the symbolizer."""
        symbolizer = self.symbolizer
        if symbolizer is None:
            return None
        if symbolizer.files_generation != self._files_key:
            # A file mapping went away: what was found by address is void.
            self._files_key = symbolizer.files_generation
            self.found.clear()
            self._forget_mapped_files()
        key = self._current_jit_key(symbolizer)
        jit = self.jit
        if key != self._jit_key:
            self._jit_key = key
            self.jit_found.clear()
            self.jit_places.clear()
            if jit is not None:
                jit.take_changes()  # forgotten with the rest
        elif jit is not None and jit.changes:  # tested here: twice a stack
            self._forget_changed_jit()
        return symbolizer

    def _forget_changed_jit(self) -> None:
        """Forget what was found in JIT code where the files gained entries
        since (``JitSymbols.changes``)."""
        jit = self.jit
        if jit is not None and jit.changes:
            changes = jit.take_changes()
            forget_in_ranges(self.jit_places, changes)
            if forget_in_ranges(self.jit_found, changes):
                self._jit_answers += 1  # whole stacks named with them are void

    def _current_jit_key(self, symbolizer: ProcessSymbolizer) -> tuple[int, int]:
        return (self.jit.epoch if self.jit is not None else -1, symbolizer.code_generation)

    def name_frames(self, addresses: Sequence[int | str]
                    ) -> tuple[list[str], list[FrameSource | None]]:
        """``lookup`` of every lookup address of one stack (markers, strings,
        pass through unlocated). A drain names tens of thousands of frames,
        nearly all cached: those are found by a pass of dictionary lookups
        (two for JIT code), only the rest one by one. The stack is named with
        the caches as they were when it began: a lookup that reads the JIT
        files or the maps again counts from the next stack."""
        names, sources, _cached = self.name_frames_cached(addresses)
        return names, sources

    def name_frames_cached(self, addresses: Sequence[int | str]
                           ) -> tuple[list[str], list[FrameSource | None], int | None]:
        """``name_frames``, and whether the caches alone answered: then how
        many frames the JIT caches answered (the same names come back for
        these addresses while ``naming_state`` stays), else None (some frame
        was looked up: asked again, it may be answered otherwise)."""
        symbolizer = self._validate_caches()
        compiled = speedups.compiled
        passed = None
        if compiled is not None and type(addresses) is list:
            passed = compiled.cached_answers(addresses, self.found, self.jit_found)
        found, jit_hits, at = self._cached_answers(addresses) if passed is None else passed
        looked_up = False
        if at >= 0 and passed is not None and symbolizer is not None and \
                self._shared_answers(symbolizer, cast("list[int | str]", addresses), found):
            looked_up = True  # as by _look_up: the stack is not kept whole
            at = found.index(None, at) if None in found else -1
        if at >= 0:
            segments = -1 if symbolizer is None else symbolizer.direct_generation
            while True:
                addr = addresses[at]
                answer = None if isinstance(addr, str) else self.jit_found.get(addr)
                if answer is not None:  # looked up for a frame before in this stack
                    found[at] = answer
                    jit_hits += 1
                elif isinstance(addr, str):
                    found[at] = (addr, None)
                elif symbolizer is None:
                    found[at], looked_up = (UNKNOWN, None), True
                else:
                    found[at], looked_up = self._look_up(symbolizer, addr), True
                    if passed is not None and symbolizer.direct_generation != segments:
                        # A first lookup in a mapping (a new process's first
                        # stack): the rest of the stack may be named there.
                        segments = symbolizer.direct_generation
                        self._shared_answers(symbolizer, cast("list[int | str]", addresses),
                                             found)
                try:
                    at = found.index(None, at + 1)
                except ValueError:
                    break
        self.count_jit_hits(jit_hits)
        cached = None if looked_up else jit_hits
        answers = cast("list[_Named]", found)
        split = None if compiled is None else compiled.split_pairs(answers)
        if split is not None:
            return split[0], split[1], cached
        if not answers:
            return [], [], cached
        names, sources = zip(*answers, strict=True)
        return list(names), list(sources), cached

    def _cached_answers(self, addresses: Sequence[int | str]
                        ) -> tuple[list[_Named | None], int, int]:
        """Each address's answer in the caches (None: a miss), how many the
        JIT caches gave, and the first miss (-1: none). ``_speedups.c`` does
        the same in C."""
        # Markers are looked up too, and miss.
        found = list(map(cast("dict[int | str, _Named]", self.found).get, addresses))
        jit_hits = 0
        if None in found:
            # Two lookups a frame and one pass to take whichever answered,
            # not a loop over the frames: stacks of Python under trampolines
            # are half JIT code.
            in_jit = map(cast("dict[int | str, _Named]", self.jit_found).get, addresses)
            files_missed = found.count(None)
            found = [answer or jit for answer, jit in zip(found, in_jit, strict=True)]
            jit_hits = files_missed - found.count(None)
        return found, jit_hits, found.index(None) if None in found else -1

    def caches(self) -> tuple[dict[int, _Answer], dict[int, _Answer], SharedPass | None]:
        """What a pass that names a whole stack reads, as ``name_frames_cached``
        reads it: the address caches of file code and of named JIT code
        (emptied first where their answers may be void), and the arguments
        of the compiled shared-name pass for the misses (None: no pass)."""
        symbolizer = self._validate_caches()
        shared = None if symbolizer is None else self._segments(symbolizer).shared
        return self.found, self.jit_found, shared

    def naming_state(self) -> tuple[int, int, int, int]:
        """What the cached answers depend on: while it stays the same, the
        caches give the same names and places for the same addresses (the
        file generation, the JIT files' epoch with the code generation, and
        how often JIT answers were forgotten in part since)."""
        self._validate_caches()
        return (self._files_key, *self._jit_key, self._jit_answers)

    def count_jit_hits(self, hits: int) -> None:
        """``hits`` frames named from the JIT caches (counted as the lookups
        they stand for, also when a whole named stack was reused)."""
        if hits and self.jit is not None:
            self.jit.count_cached_hit(hits)

    def resolve(self, addr: int) -> str:
        """The name of the code at ``addr`` (see ``lookup``)."""
        return self.lookup(addr)[0]

    def locate(self, addr: int) -> FrameSource | None:
        """Where the code at ``addr`` is (see ``lookup``)."""
        return self.lookup(addr)[1]

    def lookup(self, addr: int) -> tuple[str, FrameSource | None]:
        """The name of the code at ``addr`` and where it is: its mapping
        (file, offsets, build id) and, for JIT code with jitdump debug info,
        its source file and line. Cached per address (see the class)."""
        symbolizer = self._validate_caches()
        answer = self.found.get(addr)
        if answer is not None:
            return answer
        if symbolizer is None:
            return UNKNOWN, None
        answer = self.jit_found.get(addr)
        if answer is not None:
            self.count_jit_hits(1)
            return answer
        return self._look_up(symbolizer, addr)

    def _mapped_file(self, symbolizer: ProcessSymbolizer, mapping: Mapping) -> MappedFile:
        """The file of ``mapping`` as frames' places show it (one object a mapping)."""
        mapped = self.mapped_files.get(mapping)
        if mapped is None:
            mapped = self.mapped_files[mapping] = MappedFile(
                mapping.display_path, mapping.start, mapping.end, mapping.offset,
                symbolizer.build_id_of(mapping))
        return mapped

    def _shared_answers(self, symbolizer: ProcessSymbolizer, addresses: list[int | str],
                        found: list[_Named | None]) -> int:
        """The compiled ``shared_lookup`` of the misses in ``found``, filled
        in place and cached as ``_look_up`` caches them: how many it answered
        (0 also when it took none: ``_look_up`` then finds them)."""
        compiled = speedups.compiled
        shared = self._segments(symbolizer).shared
        if compiled is None or shared is None:
            return 0
        los, his, entries, names, max_found, frame_source = shared
        answered = compiled.shared_answers(addresses, found, los, his, entries, names,
                                           self.found, max_found, frame_source)
        return answered or 0

    def _segments(self, symbolizer: ProcessSymbolizer) -> _SharedSegments:
        """The symbolizer's direct segments as the shared-name pass takes
        them, made again when they changed."""
        segments = self._shared_segments
        if segments is None or segments.generation != symbolizer.direct_generation:
            segments = self._shared_segments = _SharedSegments.of(self, symbolizer)
        return segments

    def _look_up(self, symbolizer: ProcessSymbolizer, addr: int
                 ) -> tuple[str, FrameSource | None]:
        """``lookup`` past the caches: found by the symbolizer, then cached
        where there is code (none now: maybe some later)."""
        shared = symbolizer.shared_lookup(addr)
        name, mapping = shared if shared is not None else symbolizer.lookup(addr)
        if mapping is None:
            return name, None
        if mapping.is_anonymous:
            jit = self.jit
            # Found with the JIT files as they are now (a lookup whose re-read
            # replaced them, or changed the executable mappings, is cached
            # from the next): what their new entries void goes first.
            current = self._current_jit_key(symbolizer) == self._jit_key
            if current:
                self._forget_changed_jit()
            source = self.jit_places.get(addr)
            if source is None:
                debug = jit.debug_info(addr) if jit is not None else None
                source = FrameSource(addr) if debug is None else \
                    FrameSource(addr, None, debug[0], debug[1])
            if current:
                # A miss is not cached: it is counted, and looked up again.
                # Memory the maps show writable is cached only where the JIT
                # files named it (see ``ProcessSymbolizer.lookup``).
                if jit is not None and name not in (ANON, UNKNOWN):
                    _remember(self.jit_found, addr, (name, source))
                elif mapping.is_exec:
                    _remember(self.jit_places, addr, source)
            return name, source
        source = FrameSource(addr, self._mapped_file(symbolizer, mapping))
        if mapping.is_exec and not _remember(self.found, addr, (name, source)):
            # Emptying a full cache also forgets the mappings the old places shared.
            self._forget_mapped_files()
        return name, source


@dataclass(slots=True)
class _SharedSegments:
    """A symbolizer's direct segments as ``_speedups.shared_answers`` and
    ``cached_stack`` take them, made once a segment generation: starts,
    ends, each one's (key, bias, mapped file), and the rest of a
    ``SharedPass`` (None: no segments, no pass)."""

    generation: int  # the symbolizer's direct_generation they were made at
    shared: SharedPass | None

    @classmethod
    def of(cls, image: ProcessImage, symbolizer: ProcessSymbolizer) -> _SharedSegments:
        segments = symbolizer.direct_segments()
        if not segments:
            return cls(symbolizer.direct_generation, None)
        return cls(symbolizer.direct_generation, (
            [s.lo for s in segments], [s.hi for s in segments],
            [(s.key, s.bias, image._mapped_file(symbolizer, s.mapping)) for s in segments],
            symbolizer.shared_names, MAX_CACHED_ADDRESSES, FrameSource))


@dataclass
class JitTotals:
    """Perf map / jitdump counters summed over processes, monotonic across exits."""

    counters: Counter[tuple[str, str]] = field(default_factory=Counter)  # (kind, counter)
    entries: Counter[str] = field(default_factory=Counter)  # live entries by kind
    files: Counter[str] = field(default_factory=Counter)  # files in use by kind

    def add_image(self, image: ProcessImage, live: bool) -> None:
        if image.jit is None:
            return
        self.counters.update(image.jit.retired_counters)
        for kind, reader in image.jit.sources():
            for name, value in reader.stats.as_dict().items():
                if name not in GAUGES:
                    self.counters[(kind, name)] += value
            if live and len(reader):
                self.entries[kind] += len(reader)
                self.files[kind] += 1


@dataclass
class ProcessState:
    name: str
    metadata: ProcessMetadata
    images: dict[int, ProcessImage] = field(default_factory=dict)


def evict_to_budget(readers: Sequence[JitSymbols | DebugTable],
                    budget: int) -> tuple[int, int]:
    """Evict the perf map / jitdump indexes of processes and the debug file
    tables, least recently sampled first, until the estimated total is
    within ``budget`` bytes: (total after, evictions)."""
    total = sum(jit.memory_bytes() for jit in readers)
    evicted = 0
    for jit in sorted(readers, key=lambda j: j.note_use()):
        if total <= budget:
            break
        size = jit.memory_bytes()
        if size == 0:
            continue
        what = (f"the perf map / jitdump index of pid {jit.pid}"
                if isinstance(jit, JitSymbols) else str(jit))
        log.warning("symbol memory budget (%d bytes) used up: dropping %s (%d bytes), the least "
                    "recently sampled", budget, what, size)
        jit.evict()
        evicted += 1
        total -= size
    return total, evicted


class ProcessRegistry:
    """Per-process symbolization state with pid-reuse- and exec-safe keys."""

    def __init__(self, proc_root: str = "/proc", elf_cache: ElfCache | None = None,
                 failures: Counter[str] | None = None,
                 jit_limits: JitLimits | None = None,
                 debug_info: DebugInfo | None = None) -> None:
        self.proc_root = proc_root
        self.elf_cache = elf_cache or ElfCache()
        self.failures: Counter[str] = failures if failures is not None else Counter()
        self.symbolization_stats = SymbolizationStats()
        self.debug_info = debug_info or DebugInfo()
        self.demangler = Demangler(on_failure=self.symbolization_stats.incr)
        self.jit_limits = jit_limits or JitLimits()
        #: When the samples being named were taken: set by whoever names
        #: them, read by every process's maps and JIT file readers.
        self.horizon = SampleHorizon()
        self._table: ProcessTable[ProcessState] = ProcessTable(proc_root,
                                                               on_drop=self._retire)
        self._pending: list[ProcessEvent] = []
        self._retired = JitTotals()
        self.jit_evictions = 0
        self.jit_memory_bytes = 0
        #: Process images whose address caches were emptied to stay within
        #: ``bound_address_caches``'s bound.
        self.address_cache_evictions = 0

    def __len__(self) -> int:
        return len(self._table)

    def identities(self) -> list[ProcessIdentity]:
        return self._table.identities()

    def pids(self) -> set[int]:
        return self._table.pids()

    def identity(self, tgid: int, start_boottime_ns: int) -> ProcessIdentity:
        return ProcessIdentity(tgid, boottime_ns_to_ticks(start_boottime_ns))

    def _state(self, identity: ProcessIdentity, fallback_name: str) -> ProcessState:
        def gather() -> ProcessMetadata:  # all but the name, which the check's stat has
            return read_metadata(identity.pid, self.proc_root, comm="")

        def build(stat: ProcStat, gathered: ProcessMetadata) -> ProcessState:
            return ProcessState(name=stat.comm or fallback_name,
                                metadata=replace(gathered, comm=stat.comm))

        return self._table.get_or_create(identity.pid, identity.start_ticks, gather, build)

    def image(self, tgid: int, start_boottime_ns: int, exec_id: int,
              fallback_name: str) -> tuple[str, ProcessImage | None]:
        """Process name and the image that was running at ``exec_id``; no image
        when the process exited before the daemon ever looked at it."""
        identity = self.identity(tgid, start_boottime_ns)
        try:
            state = self._state(identity, fallback_name)
        except ProcessGone:
            self.failures["process_exited"] += 1
            return fallback_name, None
        image = state.images.get(exec_id)
        if image is None:
            if state.images and exec_id < max(state.images):
                # An image the process has left before we first looked at it.
                self.failures["image_replaced_by_exec"] += 1
                image = ProcessImage(symbolizer=None)
            else:
                image = self._image(identity.pid, start_boottime_ns)
            state.images[exec_id] = image
            while len(state.images) > MAX_IMAGES:
                self._retired.add_image(state.images.pop(min(state.images)), live=False)
        image.last_used = time.monotonic()
        return state.name, image

    def warm(self, tgid: int, start_boottime_ns: int, exec_id: int) -> ProcessImage | None:
        """Build a process image's symbolizer right away (it was just sampled
        for the first time and may not live until the next drain)."""
        identity = self.identity(tgid, start_boottime_ns)
        try:
            state = self._state(identity, "")
        except ProcessGone:
            return None
        if exec_id not in state.images:
            image = self._image(identity.pid, start_boottime_ns)
            if image.symbolizer is not None:
                image.symbolizer.preload()
            state.images[exec_id] = image
            while len(state.images) > MAX_IMAGES:
                self._retired.add_image(state.images.pop(min(state.images)), live=False)
        return state.images.get(exec_id)

    def _image(self, pid: int, start_boottime_ns: int) -> ProcessImage:
        # Reads nothing yet: the files are looked for at the first lookup
        # of JIT code (most processes have none).
        jit = JitSymbols(pid, start_boottime_ns, proc_root=self.proc_root,
                         limits=self.jit_limits, horizon=self.horizon)
        try:
            symbolizer: ProcessSymbolizer | None = ProcessSymbolizer(
                pid, self.elf_cache, self.symbolization_stats, proc_root=self.proc_root,
                anon_resolver=jit.resolve, debug_info=self.debug_info,
                demangler=self.demangler, kernel_vdso=self.kernel_vdso,
                horizon=self.horizon)
        except SymbolizationError as exc:
            self.failures["process_gone"] += 1
            log.debug("no symbolizer for pid %d: %s", pid, exc)
            symbolizer = None
        return ProcessImage(symbolizer=symbolizer, jit=jit)

    @functools.cached_property
    def kernel_vdso(self) -> KernelVdso | None:
        """The daemon's own vdso, read at the first process image."""
        return read_kernel_vdso(self.elf_cache, self.proc_root)

    def _retire(self, identity: ProcessIdentity, state: ProcessState) -> None:
        for image in state.images.values():
            self._retired.add_image(image, live=False)

    def jit_totals(self) -> JitTotals:
        """Counters of every perf map / jitdump read so far, gauges of live ones."""
        totals = JitTotals(counters=Counter(self._retired.counters))
        for image in self._live_images():
            totals.add_image(image, live=True)
        return totals

    def _live_images(self) -> list[ProcessImage]:
        """The images of every process held."""
        return [image for state in self._table.values() for image in state.images.values()]

    def _live_jit(self) -> list[JitSymbols]:
        return [image.jit for image in self._live_images() if image.jit is not None]

    def enforce_memory_budget(self, budget: int) -> int:
        """Keep the JIT indexes of live processes and the debug file tables
        within ``budget`` bytes (see ``evict_to_budget``); returns the
        estimated total."""
        readers: list[JitSymbols | DebugTable] = [*self._live_jit(), *self.debug_info.tables()]
        total, evicted = evict_to_budget(readers, budget)
        self.jit_evictions += evicted
        self.jit_memory_bytes = total
        return total

    def bound_address_caches(self, max_bytes: int) -> int:
        """Keep the address caches of all process images within ``max_bytes``
        together, at CACHED_ADDRESS_BYTES an address (``address_cache_bytes``:
        a long-lived node keeps meeting new addresses in processes that live
        for weeks): past it, empty those of the least recently sampled images
        until a quarter of the room is free again (not a few addresses at
        every drain). Returns the addresses cached after."""
        max_addresses = max_bytes // CACHED_ADDRESS_BYTES
        images = self._live_images()
        total = sum(image.cached_addresses() for image in images)
        if total <= max_addresses:
            return total
        for image in sorted(images, key=attrgetter("last_used")):
            if total <= max_addresses * 3 // 4:
                break
            cached = image.cached_addresses()
            if cached:
                total -= cached
                image.forget_addresses()
                self.address_cache_evictions += 1
        return total

    def metadata(self, pid: int) -> ProcessMetadata | None:
        """Labels of a process read when it was first seen (it may have exited since)."""
        state = self._table.get_current(pid)
        return state.metadata if state else None

    def jit_for(self, pid: int) -> JitSymbols | None:
        """The newest image's perf map / jitdump reader of ``pid``, if held."""
        state = self._table.get_current(pid)
        if state and state.images:
            return state.images[max(state.images)].jit
        return None

    def defer(self, events: list[ProcessEvent]) -> None:
        """Queue lifecycle events; they take effect after the next drain."""
        self._pending.extend(events)

    def apply_pending(self) -> None:
        events, self._pending = self._pending, []
        for event in events:
            self._table.on_event(event)

    def resync(self) -> None:
        self._table.resync()
