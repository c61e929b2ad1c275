"""Scan mode: trampoline stubs we do not control (CPython 3.12+ ``-X perf``).

There is no chain to walk: the BPF scan (``bpf/stack_scan.h``) looks for
stub return addresses in a window of the stack. This mode finds the stubs
from the process's perf map (``py::`` lines, read through the hardened
incremental reader of ``symbols.perfmap``), reads their arenas through the
one memory reader, learns and verifies their layout (``unwind.stub_layout``)
and installs it. Anything that does not check out is refused and counted.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from tramprof.model import SymbolizationError
from tramprof.procfs.identity import read_status_ids
from tramprof.procfs.maps import Mapping, read_maps
from tramprof.procfs.memory import MemoryReadError, read_memory
from tramprof.sampler import layout
from tramprof.sampler.maps import MapFull
from tramprof.symbols.perfmap import ParsedLines, PerfMap
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.mode import FP, MapWriter, ModeReport, Newcomers
from tramprof.unwind.stub_layout import (
    MAX_ARENA_BYTES,
    PAGE,
    CallerCheck,
    LayoutError,
    StubLayout,
    interpreter_text,
    learn_layout,
    verify_arena,
)

log = logging.getLogger(__name__)

WALKER = b"scan_procs"
# Bytes of the perf map read per refresh; the rest comes with later refreshes.
MAX_PERF_MAP_READ = 4 << 20
# The scan follows what is appended (new stubs, maybe in new arenas) and keeps
# no index of names: the symbolizer has that.
_PERF_MAP_CAPS = {"max_file_bytes": 64 << 20, "max_entries": 1 << 20}
# A process with anonymous executable memory whose perf map has shown no
# Python entry (node, a JVM, or a CPython without -X perf) is looked at this
# often after its first seconds, not at every refresh: reopening its perf map
# through the hardened reader every second is most of this mode's cost on a
# busy node. A change of its maps (an injection, or CPython mapping its first
# trampoline arena) brings it back at once; the looks are only the backstop,
# so each idle look doubles the wait to the next, up to MAX_IDLE_LOOK_SECONDS
# (forty node processes were ~4 reopened perf maps a second at a fixed 10 s).
IDLE_LOOK_SECONDS = 10.0
MAX_IDLE_LOOK_SECONDS = 160.0


def is_anon_exec(m: Mapping) -> bool:
    return m.is_exec and m.inode == 0 and (m.path == "" or m.path.startswith("[anon"))


def scan_record(layout_: StubLayout, arenas: Arenas, caller: CallerCheck | None
                ) -> layout.ScanProc:
    """The scan walker's per-process record (``struct tp_scan_proc``)."""
    stride = layout_.stride
    if not len(arenas) or stride <= 0 or stride & (stride - 1) or PAGE % stride:
        raise LayoutError("layout", f"stride {stride}, {len(arenas)} arenas")
    low = arenas.ranges[0][0] & ~(PAGE - 1)
    high = arenas.ranges[-1][1]
    return layout.ScanProc(
        arena_min=low, arena_span=high - low, stride_mask=stride - 1,
        return_offset=layout_.return_offset,
        caller_min=caller.start if caller else 0,
        caller_span=caller.end - caller.start if caller else 0,
        caller_offset=caller.offset if caller and caller.checks_text else 0,
        word_phase=caller.word_phase if caller else 0)


@dataclass
class ScanProcess:
    """What is installed in the BPF maps for one process."""

    layout: StubLayout
    arenas: Arenas
    caller: CallerCheck | None = None


@dataclass
class _Candidate:
    # py:: entries (address, size) appended since they were last placed in arenas
    stubs: list[tuple[int, int]] = field(default_factory=list)
    refused: str | None = None  # why the perf map was last refused
    perf_map: PerfMap | None = None
    python_seen: bool = False   # the perf map ever had a py:: entry
    next_look: float = 0.0      # monotonic; refreshes before it skip an idle candidate
    idle_wait: float = IDLE_LOOK_SECONDS  # seconds from the next idle look to the one after

    def looked_idle(self, now: float) -> None:
        """An idle look (no Python entry so far): the next in ``idle_wait``
        seconds, the one after in twice that (at most MAX_IDLE_LOOK_SECONDS)."""
        self.next_look = now + self.idle_wait
        self.idle_wait = min(2 * self.idle_wait, MAX_IDLE_LOOK_SECONDS)

    def collect(self, parsed: ParsedLines) -> None:
        """The perf map reader's new entries: keep the stubs' places."""
        python = [(start, end - start) for start, end, name
                  in zip(parsed.starts, parsed.ends, parsed.names, strict=True)
                  if name.startswith("py::")]
        self.stubs.extend(python)
        self.python_seen = self.python_seen or bool(python)


class ScanMode:
    """Per-process scan-mode state; the BPF maps follow it."""

    sample_counter = layout.Counter.SCAN_SAMPLES
    name = "scan"

    def __init__(self, maps: MapWriter, proc_root: str = "/proc") -> None:
        self._maps = maps
        self._proc_root = proc_root
        self._procs: dict[int, ScanProcess] = {}
        self._candidates: dict[int, _Candidate] = {}
        self._refused: dict[int, tuple[str, str]] = {}
        self._newcomers = Newcomers()  # -X perf writes its trampolines as code first runs
        self._errors: Counter[str] = Counter()
        self._now = time.monotonic

    def unwinds(self, pid: int) -> bool:
        return pid in self._procs

    def unwound(self) -> set[int]:
        return set(self._procs)

    def arenas(self, pid: int) -> Arenas | None:
        proc = self._procs.get(pid)
        return proc.arenas if proc is not None else None

    def errors(self) -> Counter[str]:
        return Counter(self._errors)

    def consider(self, pid: int, mappings: Sequence[Mapping]) -> None:
        """May the process run CPython's trampolines? (It has anonymous
        executable memory.)"""
        known = self._candidates.get(pid)
        if known is not None:
            # Its maps changed (new arenas, an injected -X perf): look at
            # the next refresh, and often again for a while.
            known.next_look = 0.0
            known.idle_wait = IDLE_LOOK_SECONDS
            return
        if pid in self._refused:
            return
        if not any(is_anon_exec(m) for m in mappings):
            return
        try:
            ids = read_status_ids(pid, self._proc_root)
            cand = _Candidate()
            cand.perf_map = PerfMap.for_process(pid, ids.inner_pid, ids.euid,
                                                proc_root=self._proc_root,
                                                on_entries=cand.collect, **_PERF_MAP_CAPS)
        except (OSError, IndexError, ValueError, SymbolizationError) as exc:
            log.debug("pid %d: cannot look for its perf map: %s", pid, exc)
            return
        self._candidates[pid] = cand
        self._update(pid)
        self._newcomers.add(pid)

    def refresh(self, live: set[int], full: bool = True,
                sampled: Container[int] | None = None) -> None:
        # CPython's trampolines give the walker no sign of a new arena: every
        # refresh looks (at processes whose perf map had Python entries).
        now = self._now()
        for pid, cand in list(self._candidates.items()):
            if pid not in live:
                self.forget(pid)
            elif cand.python_seen or now >= cand.next_look:
                self._update(pid)
                if not cand.python_seen and pid in self._candidates:
                    cand.looked_idle(now)
        for pid in [p for p in self._refused if p not in live]:
            del self._refused[pid]

    def follow(self, live: set[int]) -> None:
        for pid in self._newcomers.due(live, self._candidates):
            self._update(pid)

    def following(self) -> bool:
        return bool(self._newcomers)

    def forget(self, pid: int) -> None:
        # A refusal holds for the image that earned it: forgotten (the
        # process exec'd, or failed elsewhere and backed off), it is looked
        # at afresh when next considered. ``_refuse`` records after this.
        self._refused.pop(pid, None)
        self._newcomers.discard(pid)
        self._candidates.pop(pid, None)
        if self._procs.pop(pid, None) is not None:
            self._maps.remove(pid, WALKER)

    def _refuse(self, pid: int, reason: str, detail: str) -> None:
        self._errors[reason] += 1
        log.warning("pid %d: not scanning its stack for trampoline frames: %s (%s)",
                    pid, reason, detail)
        self.forget(pid)
        self._refused[pid] = (reason, detail)

    def _new_stubs(self, pid: int, cand: _Candidate) -> bool:
        """Adds the perf map's new py:: entries; True when there were any."""
        assert cand.perf_map is not None
        before = len(cand.stubs)
        result = cand.perf_map.refresh(MAX_PERF_MAP_READ)
        if result.refused is not None and result.refused not in ("missing", cand.refused):
            # Counted once per process and reason: a planted FIFO, symlink, ...
            self._errors[f"perf_map_{result.refused}"] += 1
            log.info("pid %d: perf map refused (%s)", pid, result.refused)
        cand.refused = result.refused
        if result.reloaded:  # a new file: what the old one said is void
            del cand.stubs[:before]
            before = 0
        return len(cand.stubs) > before

    def _update(self, pid: int) -> None:
        cand = self._candidates[pid]
        if not self._new_stubs(pid, cand):
            return
        known = self._procs.get(pid)
        if known is not None:
            cand.stubs = [s for s in cand.stubs if s[0] not in known.arenas]
            if not cand.stubs:
                return
        try:
            all_maps = read_maps(pid, self._proc_root)
        except (OSError, SymbolizationError) as exc:
            log.debug("pid %d: cannot read maps: %s", pid, exc)
            return
        maps = [m for m in all_maps if is_anon_exec(m)]
        arenas: dict[tuple[int, int], tuple[int, int]] = {}
        for address, size in cand.stubs:
            m = next((m for m in maps if m.start <= address < m.end), None)
            if m is not None and (m.start, m.end) not in arenas:
                arenas[(m.start, m.end)] = (address, size)
        if known is not None:
            for arena in known.arenas:
                arenas.pop(arena, None)
        if not arenas:
            cand.stubs.clear()
            return
        try:
            stub_layout = known.layout if known is not None else None
            for (start, end), (address, size) in sorted(arenas.items()):
                if end - start > MAX_ARENA_BYTES:
                    raise LayoutError("arena_size", f"{end - start} bytes at {start:#x}")
                data = read_memory(pid, start, end - start, self._proc_root)
                if stub_layout is None:
                    stub = data[address - start:address - start + size]
                    addresses = [a for a, _ in cand.stubs if start <= a < end]
                    stub_layout = learn_layout(stub, data, start, address, addresses)
                else:
                    verify_arena(data, start, stub_layout, address)
            assert stub_layout is not None
            all_arenas = (known.arenas if known else Arenas()).union(arenas)
            caller = known.caller if known is not None else \
                self._caller_check(pid, stub_layout, all_maps)
            self._maps.install(pid, WALKER, scan_record(stub_layout, all_arenas, caller),
                               all_arenas)
        except (LayoutError, MapFull) as exc:
            self._refuse(pid, getattr(exc, "reason", "map_full"), str(exc))
            return
        except ValueError as exc:  # arenas that overlap: the maps changed under us
            self._refuse(pid, "arena_overlap", str(exc))
            return
        except MemoryReadError as exc:
            log.debug("pid %d: cannot read arena: %s", pid, exc)
            return
        if known is None:
            log.info("pid %d: scanning its stack for trampoline frames (return offset %d, "
                     "stride %d, %s)", pid, stub_layout.return_offset, stub_layout.stride,
                     _describe_caller(caller))
        self._procs[pid] = ScanProcess(layout=stub_layout, arenas=all_arenas, caller=caller)
        cand.stubs.clear()

    def _caller_check(self, pid: int, stub_layout: StubLayout,
                      mappings: Sequence[Mapping]) -> CallerCheck | None:
        if stub_layout.caller_offset is None:
            return None
        try:
            exe_inode: int | None = os.stat(f"{self._proc_root}/{pid}/exe").st_ino
        except OSError:
            exe_inode = None
        text = interpreter_text(mappings, exe_inode) or (0, 0)
        return CallerCheck(stub_layout.caller_offset, *text)

    def report(self, pid: int) -> ModeReport | None:
        proc = self._procs.get(pid)
        if proc is not None:
            return ModeReport(self.name, f"CPython -X perf stubs, return offset "
                              f"{proc.layout.return_offset}, stride {proc.layout.stride}, "
                              f"{len(proc.arenas)} arenas, {_describe_caller(proc.caller)}")
        if pid in self._refused:
            reason, detail = self._refused[pid]
            return ModeReport(FP, f"trampoline stubs found but not scannable ({reason}: "
                              f"{detail})", "the stub layout is not one tramprof knows")
        return None


def _describe_caller(caller: CallerCheck | None) -> str:
    if caller is None:
        return "every word scanned, stale words not filtered: the stub's prologue is unknown"
    if not caller.checks_text:
        return ("stale words not filtered: the interpreter's text was not found "
                "(no libpython and no mapping of the executable)")
    return (f"caller's return address {caller.offset} bytes up, in "
            f"{caller.start:#x}-{caller.end:#x}")
