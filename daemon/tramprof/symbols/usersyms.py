"""User-space address -> frame name for one process.

Every address gets a printable name: the function when we can find it
(from the object's symbol tables, or from its separate debug file when the
object is stripped; demangled), otherwise the most useful fallback
(``libfoo.so+0x1a2b`` with the ELF virtual address, so ``addr2line -e
libfoo.so 0x1a2b`` works; ``[vdso]+0x..``; ``[anon]``; ``[unknown]``).
Processes exit at any moment on a real host, so nothing here raises for
that: the frame degrades and the reason is counted in a
``SymbolizationStats`` the caller owns and exports.
"""

from __future__ import annotations

import os
import stat
import threading
import time
from bisect import bisect_right
from collections import Counter
from collections.abc import Callable
from enum import StrEnum
from typing import BinaryIO, NamedTuple

from tramprof.model import ProcessGone, SymbolizationError
from tramprof.procfs.identity import read_vdso_address
from tramprof.procfs.maps import Mapping, memory_thread, process_exited, read_maps
from tramprof.procfs.memory import read_memory
from tramprof.symbols.debuginfo import DebugInfo, DebugTable
from tramprof.symbols.demangle import MANGLED_PREFIXES, Demangler
from tramprof.symbols.elf import ElfCache, ElfSymbols
from tramprof.symbols.errors import ElfError
from tramprof.symbols.horizon import SampleHorizon
from tramprof.symbols.safeopen import Refusal, open_mapping, stat_mapped_object

AnonResolver = Callable[[Mapping, int], str | None]


class _ResolverFailed(Exception):
    """The anonymous resolver raised (counted where it was called)."""


#: x86-64 vdsos are 8 KiB; anything much larger is not one.
MAX_VDSO_BYTES = 64 << 10
UNKNOWN = "[unknown]"
ANON = "[anon]"


class KernelVdso(NamedTuple):
    """The kernel's 64-bit vdso image, the same in every 64-bit process of
    this boot: read once from the daemon's own memory instead of each new
    process's (an auxv and a ``/proc/PID/mem`` read, about 40 µs each)."""

    size: int
    symbols: ElfSymbols

    def serves(self, m: Mapping) -> bool:
        """Whether ``m`` (a ``[vdso]`` line: only the kernel names one) is
        this image: as large, and above 4 GiB, where no 32-bit process
        (whose vdso differs) can map anything."""
        return m.size == self.size and m.start >= 1 << 32


def read_kernel_vdso(cache: ElfCache, proc_root: str = "/proc") -> KernelVdso | None:
    """The daemon's own vdso, parsed; None when ``proc_root`` is not this
    kernel's live ``/proc`` of the daemon's pid namespace, or without one."""
    pid = os.getpid()
    try:
        if os.readlink(f"{proc_root}/self") != str(pid):
            return None
        start = read_vdso_address(pid, proc_root)
        vdso = next((m for m in read_maps(pid, proc_root) if m.is_vdso and m.start == start),
                    None)
        if vdso is None or vdso.size > MAX_VDSO_BYTES:
            return None
        image = read_memory(pid, vdso.start, vdso.size, proc_root)
        return KernelVdso(vdso.size, cache.get_image(image))
    except (OSError, ElfError, ProcessGone, SymbolizationError):
        return None


class FailureReason(StrEnum):
    """Why a frame was not resolved to a function name (counter labels)."""

    PROCESS_GONE = "process_gone"
    PERMISSION_DENIED = "permission_denied"
    MAPS_UNREADABLE = "maps_unreadable"
    NO_MAPPING = "no_mapping"
    NOT_EXECUTABLE = "not_executable"
    FILE_UNREADABLE = "file_unreadable"
    NOT_ELF = "not_elf"
    MALFORMED_ELF = "malformed_elf"
    NO_SYMBOL = "no_symbol"
    VDSO_UNREADABLE = "vdso_unreadable"
    ANON_UNRESOLVED = "anon_unresolved"
    ANON_RESOLVER_ERROR = "anon_resolver_error"


class SymbolizationStats:
    """Counts of degraded frames by reason; shared by many symbolizers.

    Each counter counts frames (``resolve`` calls) that did not get a
    function name, so the numbers read as "samples we could not attribute";
    except ``debug_file_<refusal>`` (a separate debug file refused, once per
    lookup) and ``demangle_*`` (a name left mangled, once per name).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def incr(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._counts[str(reason)] += n

    def __getitem__(self, reason: str) -> int:
        return self._counts[str(reason)]

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters, safe to export while symbolization goes on."""
        with self._lock:
            return dict(self._counts)

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


_ObjectState = ElfSymbols | FailureReason


class DirectSegment(NamedTuple):
    """Addresses [lo, hi) of one executable file mapping whose names are
    found at (key, address + bias) of the shared names (``shared_lookup``)."""

    lo: int
    hi: int
    mapping: Mapping
    key: str  # the object's ``ElfSymbols.cache_key``
    bias: int  # from an address to the object's vaddr


def _executable(mappings: list[Mapping]) -> list[Mapping]:
    return [m for m in mappings if m.is_exec]


class ProcessSymbolizer:
    """Resolves user-space addresses of one process.

    The maps are read on first use and cached; an address in no known
    mapping triggers a re-read (when they were read before the samples being
    named were taken, else at most once per ``maps_refresh_interval``
    seconds: symbols.horizon) so libraries dlopen()ed and JIT regions
    created later are found.
    Parsed ELF objects live in the shared ``ElfCache`` and debug files in the
    shared ``DebugInfo``; this object only remembers which mapping uses which.
    Create a new symbolizer when the pid exec()s, since the old mappings then
    no longer apply.
    """

    def __init__(
        self,
        pid: int,
        elf_cache: ElfCache,
        stats: SymbolizationStats | None = None,
        *,
        proc_root: str = "/proc",
        anon_resolver: AnonResolver | None = None,
        maps_refresh_interval: float = 1.0,
        debug_info: DebugInfo | None = None,
        demangler: Demangler | None = None,
        kernel_vdso: KernelVdso | None = None,
        horizon: SampleHorizon | None = None,
    ) -> None:
        self.pid = pid
        self._horizon = horizon or SampleHorizon()
        self._kernel_vdso = kernel_vdso
        self.stats = stats if stats is not None else SymbolizationStats()
        self._cache = elf_cache
        self._proc_root = proc_root
        self._thread: int | None = None  # a running thread, once the main one exited
        self._anon_resolver = anon_resolver
        self._refresh_interval = maps_refresh_interval
        self._mappings: list[Mapping] = []
        self._starts: list[int] = []
        self._maps_loaded_at: float | None = None
        #: Bumped whenever the maps were re-read: new libraries, new JIT arenas.
        self.maps_generation = 0
        #: Bumped when the maps are first read and whenever a re-read finds
        #: the executable mappings changed (made, removed, moved, their
        #: permissions changed): which code an address is in. A re-read that
        #: finds only data mappings changed (heaps, arenas growing) leaves it.
        self.code_generation = 0
        #: Bumped when a re-read finds an executable file mapping gone
        #: (dlclose, munmap): its addresses may now hold other code, so names
        #: found by address there before are void. Other changes (the heap
        #: growing, JIT arenas) leave it alone.
        self.files_generation = 0
        self._maps_error: FailureReason | None = None
        self._objects: dict[Mapping, _ObjectState] = {}
        self._debug_info = debug_info
        self._demangler = demangler
        # Debug table of each stripped object's mapping (None: none found).
        self._debug_tables: dict[Mapping, DebugTable | None] = {}
        # Files opened by preload() and not parsed yet (shared: ElfCache.hold).
        self._held: dict[Mapping, BinaryIO] = {}
        # The segment of each executable file mapping looked up in before
        # (or whose object another process parsed), by the mapping's start
        # (``shared_lookup``). Emptied when the maps are read again.
        self._direct: dict[int, DirectSegment] = {}
        #: Changes whenever ``_direct`` does (``direct_segments``).
        self.direct_generation = 0

    # -- maps -------------------------------------------------------------

    @property
    def mappings(self) -> list[Mapping]:
        """The process's mappings (empty if it could not be read)."""
        if self._maps_loaded_at is None:
            self.reload_maps()
        return self._mappings

    def exited_unread(self) -> bool:
        """Whether the process exited before any of its maps could be read
        (they are read now if they never were): gone, or its memory already
        released (an exiting process shows empty maps before it is a
        zombie). Then none of its user frames can be named."""
        return not self.mappings and self._maps_error in (None, FailureReason.PROCESS_GONE)

    @property
    def _proc(self) -> str:
        """Where the process's memory and files show: its /proc entry, or a
        running thread's once its main thread has exited (``_read_maps``)."""
        if self._thread is None:
            return f"{self._proc_root}/{self.pid}"
        return f"{self._proc_root}/{self.pid}/task/{self._thread}"

    def _read_maps(self) -> list[Mapping]:
        """The process's maps: from its main thread's /proc entry or, once
        that thread has exited while others run on (its entry then shows no
        memory), from a running thread's, whose entry then also serves to
        open the mapped files (through its root: it has no map_files)."""
        tasks = f"{self._proc_root}/{self.pid}/task"
        if self._thread is not None:
            try:
                mappings = read_maps(self._thread, tasks)
                if mappings:
                    return mappings
            except ProcessGone:
                pass
            self._thread = None  # that thread exited: look for another
        mappings = read_maps(self.pid, self._proc_root)
        if not mappings:
            self._thread = memory_thread(self.pid, self._proc_root)
            if self._thread is not None:
                return read_maps(self._thread, tasks)
        return mappings

    def reload_maps(self) -> None:
        """Re-read ``/proc/PID/maps``, dropping state of vanished mappings."""
        self._maps_loaded_at = time.monotonic()
        try:
            mappings = self._read_maps()
        except ProcessGone:
            self._maps_error = FailureReason.PROCESS_GONE
            return
        except PermissionError:
            self._maps_error = FailureReason.PERMISSION_DENIED
            return
        except (OSError, SymbolizationError):
            self._maps_error = FailureReason.MAPS_UNREADABLE
            return
        self._maps_error = None
        self.maps_generation += 1
        if not self._mappings or _executable(mappings) != _executable(self._mappings):
            self.code_generation += 1
        if self._mappings:  # a re-read: drop what vanished (the first has nothing to drop)
            live = set(mappings)
            if any(m.is_exec and not m.is_anonymous and m not in live for m in self._mappings):
                self.files_generation += 1
            self._objects = {m: o for m, o in self._objects.items() if m in live}
            self._debug_tables = {m: t for m, t in self._debug_tables.items() if m in live}
        self._mappings = mappings
        self._starts = [m.start for m in mappings]
        self._direct = {}
        self.direct_generation += 1

    def preload(self) -> None:
        """Read the maps and open every mapped executable now, while the
        process runs: after it exits neither its maps nor its files (through
        /proc/PID/root or map_files) can be opened any more.

        Only opening is done here (cheap: a short-lived process may live just
        milliseconds); files not parsed before are parsed when first needed,
        from the descriptor held since.
        """
        self.reload_maps()
        for m in self._mappings:
            if not m.is_exec or m in self._objects or m in self._held:
                continue
            if not m.is_anonymous and not m.is_special:
                linked = stat_mapped_object(self._proc, m)
                held: ElfSymbols | BinaryIO | None = None
                if not isinstance(linked, Refusal) and stat.S_ISREG(linked.st_mode):
                    held = self._cache.known(linked)
                if held is None:
                    opened = self._open_object(m, linked)
                    if isinstance(opened, FailureReason):
                        self._objects[m] = opened
                        continue
                    held = self._cache.hold(opened)
                if isinstance(held, ElfSymbols):
                    # Parsed for another process: its names found there
                    # answer this one's first stack already.
                    self._objects[m] = held
                    self._note_segment(m, held)
                else:
                    self._held[m] = held
            elif m.is_vdso:
                self._objects[m] = self._load_vdso(m)

    def mapping_for(self, addr: int) -> Mapping | None:
        """The mapping containing ``addr`` according to the cached maps."""
        if self._maps_loaded_at is None:
            self.reload_maps()
        i = bisect_right(self._starts, addr) - 1
        if i >= 0 and addr < self._mappings[i].end:
            return self._mappings[i]
        return None

    def is_anonymous_exec(self, addr: int) -> bool:
        """True if ``addr`` is in executable memory without a file (e.g. JIT code)."""
        m = self.mapping_for(addr)
        if m is None and self._may_refresh():
            self.reload_maps()
            m = self.mapping_for(addr)
        return m is not None and m.is_anonymous_exec

    def _may_refresh(self) -> bool:
        if self._maps_error is FailureReason.PROCESS_GONE or self._maps_loaded_at is None:
            return False
        return self._horizon.may_read_again(self._maps_loaded_at, time.monotonic(),
                                            self._refresh_interval)

    # -- resolution -------------------------------------------------------

    def resolve(self, addr: int) -> str:
        """Printable frame name for ``addr``; never raises for runtime conditions."""
        return self.lookup(addr)[0]

    def lookup(self, addr: int) -> tuple[str, Mapping | None]:
        """``resolve`` and the mapping the name was found in (None: in none)."""
        m = self.mapping_for(addr)
        if m is None and self._may_refresh():
            self.reload_maps()
            m = self.mapping_for(addr)
        if m is None:
            self.stats.incr(self._maps_error or FailureReason.NO_MAPPING)
            return UNKNOWN, None
        if m.is_vdso:
            return self._resolve_vdso(m, addr), m
        if not m.is_exec:
            # A JIT makes its new code pages executable once written (V8 also
            # makes them writable again to patch or move code): maps read
            # before show them writable. A sample ran there, so what the
            # process's JIT files name there is the answer.
            if m.is_anonymous:
                try:
                    name = self._jit_name(m, addr)
                except _ResolverFailed:
                    return UNKNOWN, m
                if name is not None:
                    return name, m
            self.stats.incr(FailureReason.NOT_EXECUTABLE)
            return UNKNOWN, m
        if m.is_anonymous:
            return self._resolve_anon(m, addr), m
        if m.is_special:  # [vsyscall] and the like: the region name is the answer
            return m.display_path, m
        return self._resolve_file(m, addr), m

    def shared_lookup(self, addr: int) -> tuple[str, Mapping] | None:
        """``lookup``'s answer when it needs no search: ``addr`` is in an
        executable file mapping looked up here before, and some process has
        already found the name at that place of the file (``ElfCache``'s
        shared names). The processes of one program (workers, short-lived
        runs of one tool) mostly name code another has named. None: ask
        ``lookup``."""
        m = self.mapping_for(addr)
        if m is None:
            return None
        direct = self._direct.get(m.start)
        if direct is None or direct.mapping is not m or not direct.lo <= addr < direct.hi:
            return None
        name = self._cache.shared_name_at(direct.key, addr + direct.bias)
        return None if name is None else (name, m)

    def direct_segments(self) -> list[DirectSegment]:
        """What ``shared_lookup`` answers from, sorted by address: the
        executable segments of the file mappings looked up in before
        (``direct_generation`` says when this changes)."""
        return sorted(self._direct.values())

    @property
    def shared_names(self) -> dict[tuple[str, int], str]:
        """Names any process found, by (object key, vaddr): ``shared_lookup``
        reads a segment's place in it (only the ``ElfCache`` writes it)."""
        return self._cache.shared_names

    def _note_segment(self, m: Mapping, obj: ElfSymbols) -> None:
        """Let ``shared_lookup`` answer in ``m`` from now on."""
        if m.start not in self._direct and obj.cache_key is not None:
            span = obj.executable_span(m.offset)
            if span is not None:
                first, end, bias = span
                self._direct[m.start] = DirectSegment(
                    max(m.start, m.start + first - m.offset),
                    min(m.end, m.start + end - m.offset), m, obj.cache_key,
                    m.offset - m.start + bias)
                self.direct_generation += 1

    def _resolve_file(self, m: Mapping, addr: int) -> str:
        obj = self._objects.get(m)
        if obj is None:
            obj = self._objects[m] = self._load_object(m)
        file_offset = addr - m.start + m.offset
        if isinstance(obj, FailureReason):
            self.stats.incr(obj)
            return f"{m.basename}+0x{file_offset:x}"
        self._note_segment(m, obj)
        vaddr = obj.file_offset_to_vaddr(file_offset)
        if vaddr is None:
            self.stats.incr(FailureReason.NO_SYMBOL)
            return f"{m.basename}+0x{file_offset:x}"
        shared = self._cache.shared_name(obj, vaddr)
        if shared is not None:
            return shared
        name = None
        debug = self._debug_symbols(m, obj)
        if debug is not None:
            name = debug.resolve_vaddr(vaddr)
        if name is None:
            name = obj.resolve_vaddr(vaddr)
        if name is None:
            self.stats.incr(FailureReason.NO_SYMBOL)
            return f"{m.basename}+0x{vaddr:x}"
        demangled = self._demangler.demangle(name) if self._demangler is not None else name
        if demangled is not name or not name.startswith(MANGLED_PREFIXES):
            # Shared when final: a name left mangled (the demangler was
            # unavailable) is looked up again, as it is in its own process.
            self._cache.share_name(obj, vaddr, demangled)
        return demangled

    def _debug_symbols(self, m: Mapping, obj: ElfSymbols) -> ElfSymbols | None:
        """The separate debug file's symbols of a stripped object, looked for
        on first use (as the process sees its files, then the host's)."""
        if self._debug_info is None or obj.has_symtab:
            return None
        if m not in self._debug_tables:
            path = None if m.is_deleted or m.is_memfd else m.path
            lookup = self._debug_info.find(obj, path, f"{self._proc}/root")
            for reason in lookup.refused:
                self.stats.incr(f"debug_file_{reason}")
            self._debug_tables[m] = lookup.table
        table = self._debug_tables[m]
        return table.symbols() if table is not None else None

    def build_id_of(self, m: Mapping) -> str:
        """Hex GNU build id of the ELF object behind ``m`` once it was parsed
        (by ``resolve``), else "" (for profile formats that name binaries)."""
        obj = self._objects.get(m)
        return (obj.build_id or "") if isinstance(obj, ElfSymbols) else ""

    def _load_object(self, m: Mapping) -> _ObjectState:
        """Parse the mapped file, from the descriptor preload() held or freshly opened."""
        held = self._held.pop(m, None)
        if held is not None:  # shared with other processes (ElfCache.hold): not closed here
            return self._parse(held)
        opened = self._open_object(m)
        if isinstance(opened, FailureReason):
            return opened
        with opened:
            return self._parse(opened)

    def _parse(self, f: BinaryIO) -> _ObjectState:
        try:
            return self._cache.get_file(f)
        except ElfError as e:
            if e.reason == "not_elf":
                return FailureReason.NOT_ELF
            return FailureReason.MALFORMED_ELF
        except OSError:
            return FailureReason.FILE_UNREADABLE

    def _open_object(self, m: Mapping, linked: os.stat_result | Refusal | None = None
                     ) -> BinaryIO | FailureReason:
        """Open the mapped file the way the process sees it (``open_mapping``);
        ``linked``: its ``map_files`` stat if already made."""
        opened = open_mapping(self._proc, m, map_files_stat=linked)
        if opened is not None:
            return opened
        if process_exited(self.pid, self._proc_root):
            return FailureReason.PROCESS_GONE
        return FailureReason.FILE_UNREADABLE

    def _resolve_vdso(self, m: Mapping, addr: int) -> str:
        obj = self._objects.get(m)
        if obj is None:
            obj = self._objects[m] = self._load_vdso(m)
        offset = addr - m.start
        if isinstance(obj, ElfSymbols):
            vaddr = obj.file_offset_to_vaddr(offset)
            name = obj.resolve_vaddr(vaddr) if vaddr is not None else None
            if name is not None:
                return self._demangler.demangle(name) if self._demangler is not None else name
            self.stats.incr(FailureReason.NO_SYMBOL)
        else:
            self.stats.incr(obj)
        return f"[vdso]+0x{offset:x}"

    def _load_vdso(self, m: Mapping) -> _ObjectState:
        """The vdso is a complete ELF image in memory; read it via ``/proc/PID/mem``,
        only where the kernel says it is (auxv) and only as large as a vdso is;
        or the daemon's own copy of it (``KernelVdso``)."""
        if self._kernel_vdso is not None and self._kernel_vdso.serves(m):
            return self._kernel_vdso.symbols
        try:
            if m.size > MAX_VDSO_BYTES or read_vdso_address(self.pid, self._proc_root) != m.start:
                return FailureReason.VDSO_UNREADABLE
            data = read_memory(self.pid, m.start, m.size, self._proc_root)
            return self._cache.get_image(data)
        except (OSError, ElfError, ProcessGone):
            if process_exited(self.pid, self._proc_root):
                return FailureReason.PROCESS_GONE
            return FailureReason.VDSO_UNREADABLE

    def _resolve_anon(self, m: Mapping, addr: int) -> str:
        try:
            name = self._jit_name(m, addr)
        except _ResolverFailed:
            return ANON
        if name is None:
            self.stats.incr(FailureReason.ANON_UNRESOLVED)
            return ANON
        return name

    def _jit_name(self, m: Mapping, addr: int) -> str | None:
        """What the process's JIT files (the anonymous resolver) name at
        ``addr`` in anonymous ``m``, if anything. A failing resolver is
        counted and raises ``_ResolverFailed``."""
        if self._anon_resolver is None:
            return None
        try:
            return self._anon_resolver(m, addr) or None
        except Exception as exc:  # foreign callback: it must not break profiling
            self.stats.incr(FailureReason.ANON_RESOLVER_ERROR)
            raise _ResolverFailed from exc
