"""Names for a process's anonymous executable memory (JIT code, trampolines),
from the perf map and jitdump its runtime writes.

The files are looked for where the process itself would write them: its own
mount namespace (``/proc/PID/root``) and its own pid as it knows it (the
innermost NStgid). A containerised process never falls back to the host's
``/tmp``. Files are trusted only when owned by the process's effective uid
(or root), and only content written after the process started counts: a
file left by an earlier process with the same pid names nothing.

A lookup that misses re-reads the files when they were last read before the
samples being named were taken, else at most once per ``refresh_interval``
(symbols.horizon), so code created after the first read resolves.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tramprof.model import SymbolizationError
from tramprof.procfs.identity import read_status_ids
from tramprof.procfs.maps import Mapping
from tramprof.symbols.addrindex import MAX_CHANGES
from tramprof.symbols.horizon import SampleHorizon
from tramprof.symbols.jitdump import JitDump
from tramprof.symbols.perfmap import PerfMap
from tramprof.symbols.tailreader import RefreshResult

# The kernel stamps file times with a coarse clock (up to a jiffy behind the
# precise clock a process start is measured with).
MTIME_SLACK_NS = 20_000_000
#: Reader statistics that are gauges, not counters.
GAUGES = frozenset(("entries", "bytes_capped"))

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JitLimits:
    """Caps for the untrusted files; every one also bounds memory."""

    max_perf_map_bytes: int = 64 << 20
    max_jitdump_bytes: int = 256 << 20
    max_line_bytes: int = 4096
    max_entries: int = 2_000_000
    refresh_interval: float = 1.0
    # After an eviction by the memory budget, the files are not read again
    # for this long (seconds): a process that does not fit must not cost a
    # full re-read at every miss.
    evicted_backoff: float = 600.0


def boot_time_realtime_ns() -> int:
    """CLOCK_REALTIME at boot, to turn CLOCK_BOOTTIME stamps into file times."""
    return time.time_ns() - time.clock_gettime_ns(time.CLOCK_BOOTTIME)


@dataclass
class JitSourceReport:
    """What doctor says about one file."""

    path: str
    used: bool
    refused: str | None
    entries: int
    counters: dict[str, int] = field(default_factory=dict)


class JitSymbols:
    """Perf map + jitdump of one process; ``resolve`` fits ProcessSymbolizer."""

    def __init__(self, pid: int, start_boottime_ns: int | None = None, *,
                 proc_root: str = "/proc", limits: JitLimits | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 horizon: SampleHorizon | None = None) -> None:
        self.pid = pid
        self.limits = limits or JitLimits()
        self._horizon = horizon or SampleHorizon()
        self._clock = clock
        self._proc_root = proc_root
        self._not_before: int | None = None
        if start_boottime_ns is not None:
            self._not_before = boot_time_realtime_ns() + start_boottime_ns - MTIME_SLACK_NS
        # Made on first need (_files): where the files are depends on the
        # process's pid namespace and uid, read from its status, which most
        # processes (no JIT code ever sampled) never need read.
        self._readers: tuple[PerfMap, JitDump] | None = None
        self._ids: tuple[int, int] | None = None  # (innermost NStgid, euid)
        #: The status could not be read when the files were first needed.
        self.unavailable = False
        self._last_refresh: float | None = None
        #: Moves whenever any name may have changed (a refresh that read a
        #: replaced file, failed midway or added more ranges than are told
        #: apart; an eviction): a name found at one epoch holds until the
        #: next, except inside ``changes``.
        self.epoch = 0
        #: Ranges of the entries read since ``take_changes`` within this
        #: epoch: only there may a name found before differ now (perf maps
        #: and jitdumps only append, and the newest entry wins). A node
        #: process appends lines all the time: the names found elsewhere,
        #: nearly all, stay.
        self.changes: list[tuple[int, int]] = []
        self.last_results: tuple[RefreshResult, RefreshResult] | None = None
        self.lookups = 0
        self.resolved = 0
        # When lookups were last seen (by note_use, once per drain: never on
        # the per-sample path).
        self.last_used = self._clock()
        self._lookups_seen = 0
        self._evicted_until: float | None = None
        self.evictions = 0
        # Counters of readers dropped by evictions, so totals stay monotonic.
        self.retired_counters: Counter[tuple[str, str]] = Counter()

    def _files(self) -> tuple[PerfMap, JitDump]:
        """The two readers, made on first call. Raises ProcessGone, OSError
        or ValueError when the process's status cannot be read (it exited:
        its ``/tmp`` is gone with it)."""
        if self._readers is None:
            if self._ids is None:
                status = read_status_ids(self.pid, self._proc_root)
                self._ids = (status.inner_pid, status.euid)
            self._readers = self._new_readers(*self._ids)
        return self._readers

    def _new_readers(self, nstgid: int, euid: int) -> tuple[PerfMap, JitDump]:
        pid, proc_root, not_before = self.pid, self._proc_root, self._not_before
        return (PerfMap.for_process(
                    pid, nstgid, euid, proc_root=proc_root, not_before_ns=not_before,
                    max_file_bytes=self.limits.max_perf_map_bytes,
                    max_line_bytes=self.limits.max_line_bytes,
                    max_entries=self.limits.max_entries),
                JitDump.for_process(
                    pid, nstgid, euid, proc_root=proc_root, not_before_ns=not_before,
                    max_file_bytes=self.limits.max_jitdump_bytes,
                    max_entries=self.limits.max_entries))

    @property
    def perf_map(self) -> PerfMap:
        return self._files()[0]

    @property
    def jitdump(self) -> JitDump:
        return self._files()[1]

    def sources(self) -> tuple[tuple[str, PerfMap | JitDump], ...]:
        """(kind, reader) of both files, kinds as in the metrics; none
        before the files were first looked for."""
        if self._readers is None:
            return ()
        perf_map, jitdump = self._readers
        return (("perf_map", perf_map), ("jitdump", jitdump))

    def note_use(self) -> float:
        """Move ``last_used`` to now if there were lookups since the last call."""
        if self.lookups != self._lookups_seen:
            self._lookups_seen = self.lookups
            self.last_used = self._clock()
        return self.last_used

    def memory_bytes(self) -> int:
        """Estimated memory of both indexes."""
        return sum(reader.memory_bytes() for _kind, reader in self.sources())

    def evict(self) -> None:
        """Drop both indexes (the symbol memory budget is used up); JIT frames
        of this process stay unnamed until ``evicted_backoff`` has passed."""
        for kind, reader in self.sources():
            for name, value in reader.stats.as_dict().items():
                if name not in GAUGES:
                    self.retired_counters[(kind, name)] += value
        if self._ids is not None:
            self._readers = self._new_readers(*self._ids)
        self._new_epoch()
        self._last_refresh = None
        self.last_results = None
        self._evicted_until = self._clock() + self.limits.evicted_backoff
        self.evictions += 1

    def refresh(self) -> None:
        """Read what the files gained; raises as ``_files`` the first time."""
        perf_map, jitdump = self._files()
        self._last_refresh = self._clock()
        results = None
        try:
            results = (perf_map.refresh(), jitdump.refresh())
        finally:
            # A read that found nothing new leaves the names as they were (a
            # refusal keeps what was read before); new entries change them
            # in their ranges only; a replaced file or a read that failed
            # midway, anywhere.
            changes = [reader.take_changes() for reader in (perf_map, jitdump)]
            if results is None or any(result.reloaded for result in results) \
                    or None in changes:
                self._new_epoch()
            else:
                for ranges in changes:
                    self.changes.extend(ranges or ())
                if len(self.changes) > MAX_CHANGES:
                    self._new_epoch()
        self.last_results = results

    def _new_epoch(self) -> None:
        self.epoch += 1
        self.changes = []

    def take_changes(self) -> list[tuple[int, int]]:
        """``changes``, emptied: the caller has forgotten what it found there."""
        changes, self.changes = self.changes, []
        return changes

    def read_now(self) -> None:
        """Read the files now if they never were: a process under a
        trampoline mode may exit before the next drain names its samples,
        and its files open only while it runs (the readers keep what they
        opened, and read the rest through it then)."""
        if self._last_refresh is not None or self.unavailable:
            return
        try:
            self.refresh()
        except (OSError, ValueError, IndexError, SymbolizationError) as exc:
            self.unavailable = True
            log.debug("no perf map / jitdump lookup for pid %d: %s", self.pid, exc)

    def perf_map_written(self) -> bool:
        """Whether the process has written its perf map: what both trampoline
        modes name Python frames from, so a young interpreter without one is
        not under them yet (pipeline.young)."""
        if self.unavailable:
            return False
        try:
            return self.perf_map.written()
        except (OSError, ValueError, IndexError, SymbolizationError):
            return False

    def _lookup(self, addr: int) -> str | None:
        return self.perf_map.lookup(addr) or self.jitdump.lookup(addr)

    def count_cached_hit(self, hits: int = 1) -> None:
        """Names this index gave at its current ``epoch`` were reused from a
        cache: counted as the lookups they stand for (``note_use`` dates the
        index by lookups)."""
        self.lookups += hits
        self.resolved += hits

    def resolve(self, mapping: Mapping, addr: int) -> str | None:
        """Name of the JIT code at ``addr`` (inside anonymous executable ``mapping``)."""
        self.lookups += 1
        if self._evicted_until is not None:
            if self._clock() < self._evicted_until:
                return None
            self._evicted_until = None
        if self._last_refresh is None:
            if self.unavailable:
                return None
            try:
                self.refresh()
            except (OSError, ValueError, IndexError, SymbolizationError) as exc:
                # Exited, or a status without its ids: no files to look for.
                self.unavailable = True
                log.debug("no perf map / jitdump lookup for pid %d: %s", self.pid, exc)
                return None
        name = self._lookup(addr)
        if name is None and self._last_refresh is not None and self._horizon.may_read_again(
                self._last_refresh, self._clock(), self.limits.refresh_interval):
            self.refresh()
            name = self._lookup(addr)
        if name is not None:
            self.resolved += 1
        return name

    def debug_info(self, addr: int) -> tuple[str, int] | None:
        """Source file and line the jitdump gives for ``addr`` (None before
        the files were first read)."""
        return self._readers[1].debug_info(addr) if self._readers is not None else None

    def report(self) -> list[JitSourceReport]:
        if self._last_refresh is None:
            self.refresh()
        assert self.last_results is not None
        map_result, dump_result = self.last_results
        return [self._source(self.perf_map.path, len(self.perf_map), map_result,
                             self.perf_map.stats.as_dict()),
                self._source(self.jitdump.path, len(self.jitdump), dump_result,
                             self.jitdump.stats.as_dict())]

    @staticmethod
    def _source(path: str, entries: int, result: RefreshResult,
                counters: dict[str, int]) -> JitSourceReport:
        return JitSourceReport(path=path, used=result.refused is None and entries > 0,
                               refused=result.refused, entries=entries, counters=counters)
