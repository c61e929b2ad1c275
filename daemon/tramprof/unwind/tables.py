"""Table mode ("eh_frame"): native code without frame pointers.

The frame-pointer walk stops, or wanders, at the first frame of code built
without frame pointers (libc, libpython, zlib, any ``-O2`` C/C++/Rust). This
mode gives the BPF walker (``bpf/table_walk.h``) unwind rows for exactly the
objects that need them:

- **lazily**: an object is looked at only once a sampled frame lies in it;
- **once per object**: keyed by build id (else device, inode, size and
  mtime), so every process mapping the same library shares one table;
- **only without frame pointers**: an object whose functions keep rbp frames
  is left to the cheaper FP step;
- **within a budget** (``unwind_table_bytes`` of kernel memory): loading an
  object evicts the least recently sampled ones first.

Compiling runs on a worker thread (``unwind.cfi``: ~2 s for a 60k-row
object) so drains are never held up; finished tables are installed after the
next drain. A process gets a BPF mapping list (``tp_unwind_proc``) as soon as
one of its objects has a table; its other code is walked by frame pointers.

This is not a trampoline mode: it replaces the native walk underneath
whichever trampoline mode (chain, scan) the process also has.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Protocol

from tramprof import speedups
from tramprof.model import FrameSource
from tramprof.procfs.maps import Mapping
from tramprof.sampler import layout
from tramprof.sampler.tables import CHUNK_BYTES, PROC_BYTES, TablesFull, chunks_for
from tramprof.symbols.elf import read_build_id, stat_key
from tramprof.symbols.safeopen import open_process_mapping
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.cfi import CfiError, UnwindTable
from tramprof.unwind.cfibuild import build_in_child
from tramprof.unwind.mode import FP, ModeReport

log = logging.getLogger(__name__)

NAME = "eh_frame"
#: Objects waiting to be compiled at most; more are looked at later.
MAX_QUEUED = 64
#: An object whose table was evicted is not rebuilt sooner than this (s).
REBUILD_BACKOFF_SECONDS = 60.0


class TableWriter(Protocol):
    """Where the mode puts tables (``sampler.program.Sampler``)."""

    def load_rows(self, rows: bytes) -> int: ...

    def unload_rows(self, first_row: int) -> None: ...

    def set_unwind_process(self, tgid: int,
                           mappings: Sequence[layout.UnwindMapping]) -> None: ...

    def remove_unwind_process(self, tgid: int) -> None: ...


@dataclass
class TableObject:
    """One ELF object, shared by every process that maps it."""

    key: str
    name: str
    state: str = "queued"    # queued | loaded | frame_pointers | refused | evicted
    reason: str = ""         # refused: why
    first_row: int = -1
    rows: int = 0
    fp_share: float = 0.0
    segments: tuple[tuple[int, int, int], ...] = ()  # executable (offset, vaddr, filesz)
    last_sampled: float = 0.0
    evicted_at: float = 0.0

    @property
    def table_bytes(self) -> int:
        return chunks_for(self.rows) * CHUNK_BYTES if self.state == "loaded" else 0

    def bias(self, m: Mapping) -> int | None:
        """pc - bias = ELF address, for a mapping of this object."""
        for offset, vaddr, filesz in self.segments:
            if offset <= m.offset < offset + filesz:
                return m.start - m.offset + offset - vaddr
        return None


@dataclass
class TabledProcess:
    mappings: list[Mapping]
    index_of: dict[int, int]  # mapping start -> mapping index
    objects: dict[int, str] = field(default_factory=dict)  # mapping index -> object key
    wanted: set[int] = field(default_factory=set)          # mapping indexes to resolve
    unreadable: set[int] = field(default_factory=set)      # mapping indexes that did not open
    # Mapping indexes samples were noted in since the last refresh: a
    # drain's stacks of one process pass through the same few objects.
    noted: set[int] = field(default_factory=set)
    installed: tuple[tuple[int, int, int, int, int], ...] = ()
    # TableMode.layout_epoch when ``installed`` was worked out; -1: work it
    # out again (its objects changed, or more were loaded than fit).
    installed_epoch: int = -1


@dataclass
class TableStats:
    """Self-metrics of the tables (exported by the profiler)."""

    table_bytes: int = 0
    objects_loaded: int = 0
    rows: int = 0
    evictions: int = 0
    build_seconds: float = 0.0
    builds: Counter[str] = field(default_factory=Counter)  # result -> objects


#: Files whose object key is remembered (by device, inode, size and mtime).
MAX_REMEMBERED_KEYS = 4096


class ObjectKeys:
    """An object's key: its build id, else its file identity. The build id
    takes an ELF parse (headers and notes), and every new process of a busy
    node maps the same few files again, so it is remembered per file."""

    def __init__(self, limit: int = MAX_REMEMBERED_KEYS) -> None:
        self._limit = limit
        self._keys: OrderedDict[str, str] = OrderedDict()
        self.parses = 0

    def of(self, f: BinaryIO) -> str:
        identity = stat_key(os.fstat(f.fileno()))
        key = self._keys.get(identity)
        if key is not None:
            self._keys.move_to_end(identity)
            return key
        self.parses += 1
        build_id = read_build_id(f)
        key = f"build-id:{build_id}" if build_id else identity
        self._keys[identity] = key
        if len(self._keys) > self._limit:
            self._keys.popitem(last=False)
        return key


Built = tuple[UnwindTable, tuple[tuple[int, int, int], ...], float]


class Build:
    """One object being compiled, in a child process the worker thread waits
    for (``unwind.cfibuild``)."""

    def __init__(self, f: BinaryIO) -> None:
        self.file = f
        self.done = threading.Event()
        self.result: Built | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        began = time.monotonic()
        try:
            with self.file:
                table, segments = build_in_child(self.file)
            self.result = (table, segments, time.monotonic() - began)
        except BaseException as exc:  # reported on the daemon's thread
            self.error = exc
        finally:
            self.done.set()


class BuildWorker:
    """One daemon thread compiling objects in turn: a build in progress never
    holds up the daemon's exit (a thread pool's worker would be joined)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Build | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="tramprof-cfi", daemon=True)
        self._thread.start()

    def submit(self, f: BinaryIO) -> Build:
        build = Build(f)
        self._queue.put(build)
        return build

    def _loop(self) -> None:
        while (build := self._queue.get()) is not None:
            build.run()

    def close(self) -> None:
        self._queue.put(None)


def mapping_starts(sources: Iterable[FrameSource | None]) -> set[int]:
    """The start addresses of the mappings ``sources`` lie in (compiled: a
    drained stack's ~100 places cost ~6 us in Python, ~1.3 compiled even
    with a new mapping at every place)."""
    compiled = speedups.compiled
    starts = None if compiled is None or not isinstance(sources, (tuple, list)) \
        else compiled.mapping_starts(sources)
    if starts is None:
        starts = {source.mapping.start for source in sources
                  if source is not None and source.mapping is not None}
    return starts


class TableMode:
    """Unwind tables for the objects sampled processes spend time in."""

    name = NAME
    sample_counter = layout.Counter.TABLE_SAMPLES

    def __init__(self, writer: TableWriter, budget_bytes: int, proc_root: str = "/proc") -> None:
        self._writer = writer
        self.budget_bytes = budget_bytes
        self._proc_root = proc_root
        self._procs: dict[int, TabledProcess] = {}
        self._objects: dict[str, TableObject] = {}
        self._building: dict[str, Build] = {}
        self._keys = ObjectKeys()
        self._worker: BuildWorker | None = None
        self._errors: Counter[str] = Counter()
        self.stats = TableStats()
        self._now = time.monotonic
        #: Moves whenever an object's rows are loaded or taken out: a
        #: process's installed mappings can change only then, or when its
        #: own objects change (most refreshes change neither).
        self.layout_epoch = 0

    # -- the UnwindMode protocol ------------------------------------------

    def consider(self, pid: int, mappings: Sequence[Mapping]) -> None:
        if self.budget_bytes <= 0:
            return
        files = sorted((m for m in mappings if m.is_exec and not m.is_anonymous
                        and not m.is_special), key=lambda m: m.start)
        known = self._procs.get(pid)
        proc = TabledProcess(mappings=files, index_of={m.start: at for at, m in enumerate(files)})
        if known is not None:  # the maps changed (dlopen): keep what still holds
            old = {known.mappings[i]: key for i, key in known.objects.items()}
            proc.objects = {i: old[m] for i, m in enumerate(files) if m in old}
            proc.installed = known.installed
        self._procs[pid] = proc

    def note_code(self, pid: int, sources: Iterable[FrameSource | None]) -> None:
        """Where a drained stack of ``pid`` runs, as its frames were named
        (``FrameSource``s: their mappings): the objects among them are wanted.
        The names' per-address caches have found the mappings already; here
        they are only matched by start address, not searched frame by frame."""
        proc = self._procs.get(pid)
        if proc is None or not proc.index_of:
            return
        index_of, noted, now = proc.index_of, proc.noted, self._now()
        for start in mapping_starts(sources):
            at = index_of.get(start)
            if at is None or at in noted:
                continue
            noted.add(at)
            key = proc.objects.get(at)
            if key is None:
                proc.wanted.add(at)
                continue
            obj = self._objects[key]
            obj.last_sampled = now
            if obj.state == "evicted":
                proc.wanted.add(at)  # reloaded once the back-off has passed

    def want_all(self, pid: int) -> None:
        """Look at every executable object of ``pid`` (``doctor``), sampled or not."""
        proc = self._procs.get(pid)
        if proc is not None:
            proc.wanted.update(range(len(proc.mappings)))

    def refresh(self, live: set[int], full: bool = True,
                sampled: Container[int] | None = None) -> None:
        # What is wanted comes from drained stacks (note_code) and finished
        # builds are installed as they finish (follow): between drains there
        # is nothing new to look at.
        if not full:
            return
        for pid in [p for p in self._procs if p not in live]:
            self.forget(pid)
        if self.budget_bytes <= 0:
            return
        for pid in live & self._procs.keys():
            self._procs[pid].noted.clear()
            self._resolve_wanted(pid)
        self._collect_builds()
        for pid in live & self._procs.keys():
            self._install(pid)
        self._update_stats()

    def follow(self, live: set[int]) -> None:
        """A finished build is loaded and installed now, not at the next
        refresh: the processes that wanted it are being sampled."""
        if not any(build.done.is_set() for build in self._building.values()):
            return
        self._collect_builds()
        for pid in live & self._procs.keys():
            self._install(pid)
        self._update_stats()

    def following(self) -> bool:
        return bool(self._building)

    def forget(self, pid: int) -> None:
        proc = self._procs.pop(pid, None)
        if proc is not None and proc.installed:
            self._writer.remove_unwind_process(pid)

    def unwinds(self, pid: int) -> bool:
        proc = self._procs.get(pid)
        return proc is not None and bool(proc.installed)

    def unwound(self) -> set[int]:
        return {pid for pid, proc in self._procs.items() if proc.installed}

    def arenas(self, pid: int) -> Arenas | None:
        return None  # no stubs: the native frames themselves are exact

    def errors(self) -> Counter[str]:
        return Counter(self._errors)

    def report(self, pid: int) -> ModeReport | None:
        proc = self._procs.get(pid)
        if proc is None:
            return None
        parts = []
        problems = []
        for i, m in enumerate(proc.mappings):
            key = proc.objects.get(i)
            obj = self._objects.get(key) if key else None
            if obj is None:
                continue
            if obj.state == "loaded":
                parts.append(f"{obj.name}: no frame pointers, unwind table of {obj.rows:,} rows")
            elif obj.state == "frame_pointers":
                parts.append(f"{obj.name}: keeps frame pointers ({obj.fp_share:.0%} of "
                             "functions), no table needed")
            elif obj.state == "refused":
                problems.append(f"{obj.name}: {obj.reason}")
            else:
                parts.append(f"{obj.name} ({m.path}): {obj.state}")
        if not parts and not problems:
            return None
        mode = NAME if proc.installed else FP
        return ModeReport(mode, "unwind tables: " + "; ".join(parts + problems),
                          ("no table for " + "; ".join(problems)) if problems else "")

    # -- tables ------------------------------------------------------------

    def objects(self) -> list[TableObject]:
        return list(self._objects.values())

    def _resolve_wanted(self, pid: int) -> None:
        proc = self._procs[pid]
        wanted, proc.wanted = proc.wanted, set()
        now = self._now()
        for at in sorted(wanted):
            if at >= len(proc.mappings) or at in proc.unreadable:
                continue
            known = self._objects.get(proc.objects.get(at, ""))
            if known is not None and not (known.state == "evicted" and
                                          now - known.evicted_at >= REBUILD_BACKOFF_SECONDS):
                continue
            m = proc.mappings[at]
            f = open_process_mapping(self._proc_root, pid, m)
            if f is None:
                self._errors["object_unreadable"] += 1
                proc.unreadable.add(at)
                continue
            try:
                key = self._keys.of(f)
            except (OSError, ValueError) as exc:
                f.close()
                self._errors["object_unreadable"] += 1
                proc.unreadable.add(at)
                log.debug("pid %d: %s: %s", pid, m.path, exc)
                continue
            proc.objects[at] = key
            proc.installed_epoch = -1
            obj = self._objects.get(key)
            if obj is None:
                obj = self._objects[key] = TableObject(key=key, name=m.basename)
            obj.last_sampled = self._now()
            if obj.state == "evicted" and self._now() - obj.evicted_at >= REBUILD_BACKOFF_SECONDS:
                obj.state = "queued"
            if obj.state == "queued" and key not in self._building:
                if len(self._building) >= MAX_QUEUED:
                    del proc.objects[at]  # looked at again when sampled again
                    f.close()
                    continue
                self._building[key] = self._pool().submit(f)
            else:
                f.close()

    def _pool(self) -> BuildWorker:
        if self._worker is None:
            self._worker = BuildWorker()
        return self._worker

    def wait_for_builds(self, timeout: float) -> None:
        """Block until queued builds finish (tests and ``doctor``)."""
        deadline = self._now() + timeout
        for build in list(self._building.values()):
            build.done.wait(max(0.0, deadline - self._now()))

    def _collect_builds(self) -> None:
        for key, build in list(self._building.items()):
            if not build.done.is_set():
                continue
            del self._building[key]
            obj = self._objects[key]
            if isinstance(build.error, (CfiError, OSError, ValueError)):
                self._refuse(obj, "no_usable_cfi", str(build.error))
                continue
            if build.error is not None or build.result is None:
                # pyelftools on a hostile object raises what it likes.
                self._refuse(obj, "malformed_object",
                             f"{type(build.error).__name__}: {build.error}")
                continue
            table, segments, seconds = build.result
            self.stats.build_seconds += seconds
            obj.rows, obj.fp_share, obj.segments = table.row_count, table.fp_share, segments
            if table.frame_pointers:
                obj.state = "frame_pointers"
                self.stats.builds["frame_pointers"] += 1
                continue
            if table.row_count == 0 or not segments:
                self._refuse(obj, "no_usable_cfi", "no .eh_frame or .debug_frame rows")
                continue
            self._load(obj, table)

    def _refuse(self, obj: TableObject, reason: str, detail: str) -> None:
        obj.state, obj.reason = "refused", f"{reason}: {detail}"
        self._errors[reason] += 1
        self.stats.builds[reason] += 1
        log.info("no unwind table for %s: %s", obj.name, obj.reason)

    def _used_bytes(self) -> int:
        tabled = sum(1 for p in self._procs.values() if p.installed)
        return sum(o.table_bytes for o in self._objects.values()) + tabled * PROC_BYTES

    def _load(self, obj: TableObject, table: UnwindTable) -> None:
        need = chunks_for(table.row_count) * CHUNK_BYTES
        if need + PROC_BYTES > self.budget_bytes:
            self._refuse(obj, "budget", f"{need:,} bytes of rows exceed unwind_table_bytes")
            return
        victims = sorted((o for o in self._objects.values() if o.state == "loaded"),
                         key=lambda o: o.last_sampled)
        while self._used_bytes() + need > self.budget_bytes and victims:
            self._evict(victims.pop(0))
        for _attempt in range(2):
            try:
                obj.first_row = self._writer.load_rows(table.rows)
                break
            except TablesFull:
                if not victims:
                    self._refuse(obj, "budget", "no room for its rows")
                    return
                self._evict(victims.pop(0))
            except OSError as exc:
                self._refuse(obj, "map_error", str(exc))
                return
        else:
            self._refuse(obj, "budget", "no room for its rows")
            return
        obj.state = "loaded"
        self.layout_epoch += 1
        self.stats.builds["loaded"] += 1

    def _evict(self, obj: TableObject) -> None:
        """Take an object's rows out of every process, then out of the maps."""
        first = obj.first_row
        obj.state, obj.first_row, obj.evicted_at = "evicted", -1, self._now()
        self.layout_epoch += 1
        for pid in self._procs:
            self._install(pid)
        self._writer.unload_rows(first)
        self.stats.evictions += 1

    def _install(self, pid: int) -> None:
        proc = self._procs[pid]
        if proc.installed_epoch == self.layout_epoch:
            return
        entries = []
        for at, key in proc.objects.items():
            obj = self._objects.get(key)
            if obj is None or obj.state != "loaded":
                continue
            m = proc.mappings[at]
            bias = obj.bias(m)
            if bias is None:
                continue
            entries.append((obj.last_sampled, m.start, m.end, bias % (1 << 64), obj.first_row,
                            obj.rows))
        # Most recently sampled objects first when there are too many.
        entries.sort(key=lambda e: -e[0])
        chosen = sorted(e[1:] for e in entries[:layout.MAX_UNWIND_MAPPINGS])
        record = tuple(chosen)
        # Past the limit the choice follows when objects were last sampled:
        # worked out again at every refresh.
        epoch = self.layout_epoch if len(entries) <= layout.MAX_UNWIND_MAPPINGS else -1
        if record != proc.installed:
            if record:
                self._writer.set_unwind_process(pid, [
                    layout.UnwindMapping(start=s, end=e, bias=b, first_row=f, nr_rows=n)
                    for s, e, b, f, n in record])
            else:
                self._writer.remove_unwind_process(pid)
            proc.installed = record
        proc.installed_epoch = epoch

    def _update_stats(self) -> None:
        loaded = [o for o in self._objects.values() if o.state == "loaded"]
        self.stats.objects_loaded = len(loaded)
        self.stats.rows = sum(o.rows for o in loaded)
        self.stats.table_bytes = self._used_bytes()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

