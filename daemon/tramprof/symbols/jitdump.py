"""Live reader for ``/tmp/jit-PID.dump`` (perf's jitdump format); one job, over
400 lines because the format has six record types in two byte orders.

Runtimes that know more than a name per code blob (V8 ``--perf-prof``,
CPython 3.13 ``-X perf_jit``, the JVM perf agent) write jitdump: a 40-byte
file header, then records ``{u32 id, u32 total_size, u64 timestamp}`` +
payload.  The file declares its byte order through the magic (0x4A695444,
or 0x4454694A when written on a machine of the other endianness).

Kept per piece of code: name, address, size, code index, source lines from
the DEBUG_INFO record that precedes its CODE_LOAD, and the ``.eh_frame`` /
``.eh_frame_hdr`` bytes from the UNWINDING_INFO record that precedes it
(written eh_frame first, header last, as perf's ELF writer lays them out).
Native code bytes are never kept.

The same rules as for perf maps apply: opened with
:func:`~tramprof.symbols.safeopen.open_untrusted`, read incrementally with a
byte cap, reloaded when the file is replaced or truncated.  A record that is
only partly written is left for the next refresh.  A record whose size is
below 16 or above ``max_record_bytes``, or a bad file header, makes the rest
of the file unreadable (``corrupt`` is counted once, and parsing resumes
only when the file is replaced).  A record of a known type whose payload is
inconsistent is skipped and counted in ``bad_records``; unknown record types
are skipped by their size.
"""

from __future__ import annotations

import struct
import sys
from array import array
from bisect import bisect_right
from dataclasses import dataclass, replace
from typing import Final

from tramprof.symbols.addrindex import U64_MAX, AddrIndex
from tramprof.symbols.names import SHARED_NAMES
from tramprof.symbols.safeopen import IO_ERROR, Refusal
from tramprof.symbols.tailreader import (
    ProcessTmpFile,
    RefreshResult,
    SourceStats,
    TailReader,
    checked_pid,
    process_tmp_file,
)

#: Memory per code entry besides its name and unwinding/debug data (a JitCode,
#: its index slots and its by-address slot), measured with tracemalloc
#: (tests/unit/test_jitdump.py checks the estimate).
ENTRY_BYTES = 260

JITDUMP_MAGIC: Final = 0x4A695444
JITDUMP_MAGIC_SWAPPED: Final = 0x4454694A
JITDUMP_VERSION: Final = 1
FILE_HEADER_SIZE: Final = 40
RECORD_HEADER_SIZE: Final = 16
_MAX_FILE_HEADER_SIZE: Final = 4096

CODE_LOAD: Final = 0
CODE_MOVE: Final = 1
DEBUG_INFO: Final = 2
CODE_CLOSE: Final = 3
UNWINDING_INFO: Final = 4

DEFAULT_MAX_FILE_BYTES: Final = 256 << 20
DEFAULT_MAX_RECORD_BYTES: Final = 16 << 20
DEFAULT_MAX_ENTRIES: Final = 1_000_000
DEFAULT_MAX_UNWIND_BYTES: Final = 64 << 10
DEFAULT_MAX_DEBUG_LINES: Final = 1_000_000
DEFAULT_CHUNK_BYTES: Final = 1 << 20
# Source lines further than this from the code start are garbage.
_MAX_CODE_OFFSET: Final = (1 << 32) - 1
# DEBUG_INFO records waiting for their CODE_LOAD; older ones are dropped.
_MAX_PENDING_DEBUG: Final = 1024


class _Layout:
    """``struct`` layouts for one byte order."""

    def __init__(self, order: str) -> None:
        self.header = struct.Struct(order + "IIIIIIQQ")
        self.record = struct.Struct(order + "IIQ")
        self.load = struct.Struct(order + "IIQQQQ")
        self.move = struct.Struct(order + "IIQQQQQ")
        self.debug = struct.Struct(order + "QQ")
        self.debug_entry = struct.Struct(order + "QII")
        self.unwind = struct.Struct(order + "QQQ")


_LITTLE: Final = _Layout("<")
_BIG: Final = _Layout(">")


@dataclass(frozen=True, slots=True)
class JitHeader:
    """The file header, byte order already applied."""

    version: int
    elf_mach: int
    pid: int
    timestamp: int
    flags: int
    header_size: int
    big_endian: bool


@dataclass(frozen=True, slots=True)
class DebugLines:
    """Source positions of one piece of code, sorted by offset from its start."""

    offsets: array[int]
    lines: array[int]
    files: tuple[str, ...]

    def at(self, offset: int) -> tuple[str, int] | None:
        """(file, line) of the last entry at or before ``offset``."""
        i = bisect_right(self.offsets, offset) - 1
        if i < 0:
            return None
        return self.files[i], self.lines[i]


@dataclass(frozen=True, slots=True)
class JitUnwind:
    """Unwinding data from an UNWINDING_INFO record."""

    eh_frame: bytes
    eh_frame_hdr: bytes
    mapped_size: int


@dataclass(frozen=True, slots=True)
class JitCode:
    """One piece of generated code as last loaded or moved."""

    name: str
    code_addr: int
    code_size: int
    code_index: int
    debug: DebugLines | None = None
    unwind: JitUnwind | None = None


@dataclass
class JitDumpStats(SourceStats):
    """Counters of one jitdump reader.

    ``records``: complete records parsed (all types).  ``code_loads``,
    ``code_moves``, ``debug_infos``, ``unwind_infos``, ``closes``: per type.
    ``unknown_records``: records of other types, skipped.  ``bad_records``:
    known records with inconsistent payload, skipped (also moves of code
    never loaded).  ``corrupt``: times a file became unreadable (bad header
    or record size).  ``dropped_entries``: loads ignored at ``max_entries``.
    ``debug_lines_dropped``: source lines over the cap or pointing outside
    their code.  ``unwind_dropped``: unwinding records over the size cap.
    ``entries`` (gauge): pieces of code currently known from this file.
    """

    records: int = 0
    code_loads: int = 0
    code_moves: int = 0
    debug_infos: int = 0
    unwind_infos: int = 0
    closes: int = 0
    unknown_records: int = 0
    bad_records: int = 0
    corrupt: int = 0
    dropped_entries: int = 0
    debug_lines_dropped: int = 0
    unwind_dropped: int = 0
    entries: int = 0


class _BadRecord(Exception):
    """A known record whose payload does not hold together."""


def jitdump_path(pid: int, nstgid_innermost: int, proc_root: str = "/proc") -> str:
    """Path of a process's jitdump inside its own mount namespace (never the host's /tmp)."""
    path, root = process_tmp_file(
        pid, JitDump.FILE_NAME.format(checked_pid(nstgid_innermost)), proc_root)
    return f"{root}/{path}"


def _cstring(data: bytes, start: int, end: int) -> tuple[str, int]:
    """Decode the NUL-terminated string at ``start``; return it and the byte
    after the NUL. Shared (``symbols.names``): processes running the same code
    name it, and its debug info's source files, alike."""
    nul = data.find(b"\0", start, end)
    if nul < 0:
        raise _BadRecord("string without NUL")
    return SHARED_NAMES.one(data[start:nul].decode("utf-8", "replace")), nul + 1


class JitDump(ProcessTmpFile):
    """Incremental, hardened reader of one jitdump file.

    Prefer :meth:`for_process`, which resolves the path inside the process's
    mount namespace without following symlinks.  Not thread-safe: lookups
    build the index lazily, so refresh and look up from one thread.

    Caps: ``max_file_bytes`` (bytes of the file ever read; jitdumps carry
    machine code, hence the larger default), ``max_record_bytes`` (larger
    records mean corruption), ``max_entries`` (index entries: loads, plus
    two per move), ``max_unwind_bytes`` (per UNWINDING_INFO; larger ones are
    not kept), ``max_debug_lines`` (source lines kept from the whole file).
    """

    FILE_NAME = "jit-{}.dump"

    def __init__(
        self,
        path: str,
        expected_uid: int | None,
        *,
        root: str | None = None,
        not_before_ns: int | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_unwind_bytes: int = DEFAULT_MAX_UNWIND_BYTES,
        max_debug_lines: int = DEFAULT_MAX_DEBUG_LINES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if max_record_bytes < RECORD_HEADER_SIZE:
            raise ValueError("max_record_bytes is smaller than a record header")
        self.stats = JitDumpStats()
        self._tail = TailReader(path, expected_uid, max_file_bytes, self.stats, root=root,
                                not_before_ns=not_before_ns, skip_stale_prefix=False)
        self._max_record = max_record_bytes
        self._max_entries = max_entries
        self._max_unwind = max_unwind_bytes
        self._max_debug_lines = max_debug_lines
        self._chunk_bytes = chunk_bytes
        self._index: AddrIndex[JitCode] = AddrIndex()
        # Loads and moves placed in the index, ever (for RefreshResult).
        self._placed = 0
        self._reset()

    def _reset(self) -> None:
        self._index.clear()
        self._payload_bytes = 0
        self.header: JitHeader | None = None
        #: Why the current file stopped being parsed, if it did.
        self.corrupt_reason: str | None = None
        #: A CODE_CLOSE record was seen.
        self.closed = False
        self._layout = _LITTLE
        self._by_addr: dict[int, JitCode] = {}
        self._pending_debug: dict[int, DebugLines] = {}
        self._pending_unwind: JitUnwind | None = None
        self._debug_lines_kept = 0
        self._files: dict[str, str] = {}


    # -- reading ---------------------------------------------------------

    def refresh(self, max_bytes: int | None = None) -> RefreshResult:
        """Parse the records appended since the last refresh (or reload).

        ``max_bytes`` bounds the bytes read by this call (at least one chunk
        is read); the rest is picked up by later refreshes.
        """
        session = self._tail.open()
        if isinstance(session, Refusal):
            return RefreshResult(refused=session.reason)
        before = self._placed
        with session:
            if session.reset:
                self._reset()
            try:
                if self.corrupt_reason is None:
                    for chunk in session.chunks(self._chunk_bytes, max_bytes):
                        used, want = self._consume(chunk)
                        session.want = want
                        session.commit(chunk, used)
                        if self.corrupt_reason is not None:
                            break
            except OSError as err:
                refusal = self._tail.refuse(Refusal(IO_ERROR, f"read: {err}"))
                return RefreshResult(refused=refusal.reason, new_entries=self._placed - before)
            remaining = session.remaining
        self.stats.entries = len(self._by_addr)
        return RefreshResult(
            reloaded=session.reloaded,
            bytes_read=session.read_bytes,
            new_entries=self._placed - before,
            capped=session.capped,
            remaining=remaining,
        )

    def _corrupt(self, reason: str) -> None:
        self.corrupt_reason = reason
        self.stats.corrupt += 1

    def _consume(self, data: bytes) -> tuple[int, int]:
        """Parse whole records in ``data``; return (bytes used, bytes wanted next)."""
        pos = 0
        if self.header is None:
            if len(data) < FILE_HEADER_SIZE:
                return 0, FILE_HEADER_SIZE
            header = self._parse_header(data)
            if header is None:
                return 0, 0
            if len(data) < header.header_size:
                return 0, header.header_size
            self.header = header
            pos = header.header_size
        layout = self._layout
        end = len(data)
        stats = self.stats
        while end - pos >= RECORD_HEADER_SIZE:
            rec_id, size, _timestamp = layout.record.unpack_from(data, pos)
            if size < RECORD_HEADER_SIZE or size > self._max_record:
                self._corrupt("bad_record_size")
                break
            if end - pos < size:
                return pos, size  # written partly: wait for the rest
            stats.records += 1
            try:
                self._record(rec_id, data, pos + RECORD_HEADER_SIZE, pos + size)
            except (_BadRecord, struct.error):
                stats.bad_records += 1
            pos += size
        return pos, 0

    def _parse_header(self, data: bytes) -> JitHeader | None:
        (magic,) = struct.unpack_from("<I", data, 0)
        if magic == JITDUMP_MAGIC:
            layout = _LITTLE
        elif magic == JITDUMP_MAGIC_SWAPPED:
            layout = _BIG
        else:
            self._corrupt("bad_magic")
            return None
        _, version, size, mach, _pad, pid, ts, flags = layout.header.unpack_from(data, 0)
        if version != JITDUMP_VERSION:
            self._corrupt("bad_version")
            return None
        if not FILE_HEADER_SIZE <= size <= _MAX_FILE_HEADER_SIZE:
            self._corrupt("bad_header_size")
            return None
        self._layout = layout
        return JitHeader(version, mach, pid, ts, flags, size, layout is _BIG)

    def _record(self, rec_id: int, data: bytes, start: int, end: int) -> None:
        stats = self.stats
        if rec_id == CODE_LOAD:
            stats.code_loads += 1
            self._code_load(data, start, end)
        elif rec_id == CODE_MOVE:
            stats.code_moves += 1
            self._code_move(data, start, end)
        elif rec_id == DEBUG_INFO:
            stats.debug_infos += 1
            self._debug_info(data, start, end)
        elif rec_id == CODE_CLOSE:
            stats.closes += 1
            self.closed = True
        elif rec_id == UNWINDING_INFO:
            stats.unwind_infos += 1
            self._unwinding_info(data, start, end)
        else:
            stats.unknown_records += 1

    def _code_load(self, data: bytes, start: int, end: int) -> None:
        layout = self._layout
        # The preceding DEBUG_INFO/UNWINDING_INFO belong to this load even if
        # the load itself turns out unusable.
        unwind, self._pending_unwind = self._pending_unwind, None
        if end - start < layout.load.size:
            raise _BadRecord("short CODE_LOAD")
        fields = layout.load.unpack_from(data, start)
        _rec_pid, _tid, _vma, code_addr, code_size, code_index = fields
        debug = self._pending_debug.pop(code_addr, None)
        name, after_name = _cstring(data, start + layout.load.size, end)
        if after_name + code_size > end:
            raise _BadRecord("code runs past the record")
        if code_size == 0:
            return  # allowed by the spec; nothing can be sampled in it
        if code_addr + code_size > U64_MAX:
            raise _BadRecord("code past the end of the address space")
        if self._index.added >= self._max_entries:
            self.stats.dropped_entries += 1
            return
        code = JitCode(sys.intern(name), code_addr, code_size, code_index, debug, unwind)
        self._index.add(code_addr, code_addr + code_size, code)
        self._payload_bytes += len(name) + (
            len(unwind.eh_frame) + len(unwind.eh_frame_hdr) if unwind else 0) + (
            16 * len(debug.offsets) if debug else 0)
        self._by_addr[code_addr] = code
        self._placed += 1

    def _code_move(self, data: bytes, start: int, end: int) -> None:
        layout = self._layout
        if end - start < layout.move.size:
            raise _BadRecord("short CODE_MOVE")
        _rec_pid, _tid, _vma, old_addr, new_addr, code_size, code_index = layout.move.unpack_from(
            data, start
        )
        code = self._by_addr.get(old_addr)
        if code is None or code.code_index != code_index:
            raise _BadRecord("CODE_MOVE of code never loaded")
        size = code_size or code.code_size
        if new_addr + size > U64_MAX:
            raise _BadRecord("code past the end of the address space")
        if self._index.added + 2 > self._max_entries:
            self.stats.dropped_entries += 1
            return
        del self._by_addr[old_addr]
        moved = replace(code, code_addr=new_addr, code_size=size)
        # The old range is vacated: hide it, then show the code at its new place.
        self._index.add(old_addr, old_addr + code.code_size, None)
        self._index.add(new_addr, new_addr + size, moved)
        self._by_addr[new_addr] = moved
        self._placed += 1

    def _debug_info(self, data: bytes, start: int, end: int) -> None:
        layout = self._layout
        if end - start < layout.debug.size:
            raise _BadRecord("short DEBUG_INFO")
        code_addr, nr_entry = layout.debug.unpack_from(data, start)
        room = max(0, self._max_debug_lines - self._debug_lines_kept)
        keep = min(nr_entry, room)
        if nr_entry > keep:
            self.stats.debug_lines_dropped += nr_entry - keep
        entry = layout.debug_entry
        pos = start + layout.debug.size
        rows: list[tuple[int, int, str]] = []
        files = self._files
        outside = 0
        for _ in range(keep):
            if end - pos < entry.size:
                raise _BadRecord("DEBUG_INFO entries run past the record")
            addr, line, _discrim = entry.unpack_from(data, pos)
            name, pos = _cstring(data, pos + entry.size, end)
            offset = addr - code_addr
            if 0 <= offset <= _MAX_CODE_OFFSET:
                rows.append((offset, line, files.setdefault(name, name)))
            else:
                outside += 1  # points before the code or far past it (seen from V8)
        self.stats.debug_lines_dropped += outside
        if not rows:
            return
        rows.sort(key=lambda row: row[0])
        self._debug_lines_kept += len(rows)
        lines = DebugLines(
            array("L", [r[0] for r in rows]),
            array("I", [r[1] for r in rows]),
            tuple(r[2] for r in rows),
        )
        pending = self._pending_debug
        pending.pop(code_addr, None)
        if len(pending) >= _MAX_PENDING_DEBUG:
            stale = next(iter(pending))
            self.stats.debug_lines_dropped += len(pending.pop(stale).offsets)
        pending[code_addr] = lines

    def _unwinding_info(self, data: bytes, start: int, end: int) -> None:
        layout = self._layout
        self._pending_unwind = None
        if end - start < layout.unwind.size:
            raise _BadRecord("short UNWINDING_INFO")
        unwind_size, hdr_size, mapped_size = layout.unwind.unpack_from(data, start)
        body = start + layout.unwind.size
        if hdr_size > unwind_size or body + unwind_size > end:
            raise _BadRecord("UNWINDING_INFO sizes do not fit the record")
        if unwind_size > self._max_unwind:
            self.stats.unwind_dropped += 1
            return
        split = body + unwind_size - hdr_size
        self._pending_unwind = JitUnwind(
            eh_frame=data[body:split],
            eh_frame_hdr=data[split : body + unwind_size],
            mapped_size=mapped_size,
        )

    # -- lookups ---------------------------------------------------------

    def memory_bytes(self) -> int:
        """Estimated memory held by the index (what the symbol budget counts)."""
        return self._index.added * ENTRY_BYTES + self._payload_bytes

    def entry(self, addr: int) -> JitCode | None:
        """The newest code covering ``addr``, or None."""
        return self._index.lookup(addr)

    def lookup(self, addr: int) -> str | None:
        """Name of the newest code covering ``addr``, or None."""
        code = self._index.lookup(addr)
        return code.name if code is not None else None

    def debug_info(self, addr: int) -> tuple[str, int] | None:
        """(source file, line) for ``addr`` from the code's DEBUG_INFO, or None."""
        code = self._index.lookup(addr)
        if code is None or code.debug is None:
            return None
        return code.debug.at(addr - code.code_addr)

    def unwind_info(self, addr: int) -> bytes | None:
        """``.eh_frame`` bytes for the code covering ``addr``, or None.

        Empty bytes mean the writer sent only an ``.eh_frame_hdr`` (V8 does
        this to say "use frame pointers").  See :meth:`entry` for the header
        and the code's start address the frame data refers to.
        """
        code = self._index.lookup(addr)
        if code is None or code.unwind is None:
            return None
        return code.unwind.eh_frame

    def symbols(self) -> list[tuple[int, int, JitCode]]:
        """Every visible range in address order."""
        return self._index.items()

    def take_changes(self) -> list[tuple[int, int]] | None:
        """Address ranges whose lookups may answer differently since the last
        call (None: any may); see ``AddrIndex.take_changes``."""
        return self._index.take_changes()

    def __len__(self) -> int:
        return len(self._by_addr)
