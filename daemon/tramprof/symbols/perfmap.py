"""Live reader for ``/tmp/perf-PID.map`` files.

JIT runtimes (CPython ``-X perf``, Node ``--perf-basic-prof``, JVM agents,
.NET) append one line per piece of generated code::

    START SIZE NAME

``START`` and ``SIZE`` are hex (either case, optional ``0x`` as JDK 25 writes
it), separated by spaces or tabs, and ``NAME`` is the rest of the line and may
contain spaces.  Leading whitespace and CRLF endings are accepted, blank
lines are skipped silently.  A line is *malformed* (counted, skipped) when a
field is missing or not hex, a number has more than 16 digits, the size is
zero, the range runs past 2**64, or the line contains a NUL byte.  Names are
decoded as UTF-8 with replacement characters, and shared between processes
(``symbols.names``).  A line longer than
``max_line_bytes`` is skipped and counted in ``long_lines`` without ever
being held in memory whole.

The file is read incrementally (see :mod:`tramprof.symbols.tailreader`): a
refresh reads only what was appended, and a half-written last line is read
again, completed, on a later refresh.  Lookups resolve overlapping ranges
newest-first (see :mod:`tramprof.symbols.addrindex`).
"""

from __future__ import annotations

import gc
import re
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import compress, repeat
from operator import add
from typing import Any, Final

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

DEFAULT_MAX_FILE_BYTES: Final = 64 << 20
DEFAULT_MAX_LINE_BYTES: Final = 4096
DEFAULT_MAX_ENTRIES: Final = 2_000_000
DEFAULT_CHUNK_BYTES: Final = 1 << 20
#: Memory per entry besides its name's characters (two array slots, a list
#: slot, the str object): 75 bytes measured with tracemalloc on 100,000
#: entries (tests/unit/test_perfmap.py checks the estimate).
ENTRY_BYTES: Final = 80

_LINE: Final = re.compile(
    rb"^[ \t]*(?:0[xX])?([0-9a-fA-F]{1,16})[ \t]+(?:0[xX])?([0-9a-fA-F]{1,16})"
    rb"[ \t]+([^\x00\s][^\x00\r\n]*)\r?$",
    re.MULTILINE,
)


@dataclass
class PerfMapStats(SourceStats):
    """Counters of one perf map reader.

    ``lines_parsed``: lines that became entries.  ``malformed``: non-blank
    lines rejected.  ``long_lines``: lines over the length cap.
    ``dropped_entries``: valid lines ignored because ``max_entries`` was
    reached.  ``entries`` (gauge): entries accepted from the current file.
    """

    lines_parsed: int = 0
    malformed: int = 0
    long_lines: int = 0
    dropped_entries: int = 0
    entries: int = 0


@dataclass(slots=True)
class ParsedLines:
    """Entries from a block of complete lines, in file order."""

    starts: array[int]
    ends: array[int]
    names: list[str]
    malformed: int = 0
    long_lines: int = 0


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while a block allocates many objects that form no
    cycles (one tuple per perf map line; the samples and stacks of a drain).

    Every collection their allocations trigger walks the daemon's whole heap
    for no garbage: parsing a big map took about half again as long, a
    999 Hz drain on a busy host a third more.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def parse_lines(block: bytes, max_line_bytes: int = DEFAULT_MAX_LINE_BYTES) -> ParsedLines:
    """Parse ``block``, which must consist of whole ``\\n``-terminated lines."""
    n_lines = block.count(b"\n")
    lines: list[bytes] | None = None
    long_lines = 0
    if len(block) - n_lines > max_line_bytes:
        lines = block.split(b"\n")
        lines.pop()
        if max(map(len, lines)) > max_line_bytes:
            short = [len(line) <= max_line_bytes for line in lines]
            long_lines = short.count(False)
            lines = list(compress(lines, short))
            block = b"\n".join(lines) + b"\n" if lines else b""
    rows: list[tuple[Any, ...]] = _LINE.findall(block)
    malformed = 0
    if len(rows) + long_lines != n_lines:
        if lines is None:
            lines = block.split(b"\n")
            lines.pop()
        blank = list(map(bytes.strip, lines)).count(b"")
        malformed = len(lines) - blank - len(rows)
    if not rows:
        return ParsedLines(array("Q"), array("Q"), [], malformed, long_lines)
    hex_starts, hex_sizes, raw_names = zip(*rows, strict=True)
    starts = list(map(int, hex_starts, repeat(16)))
    sizes = list(map(int, hex_sizes, repeat(16)))
    ends = list(map(add, starts, sizes))
    if 0 in sizes or max(ends) > U64_MAX:
        keep = [size > 0 and end <= U64_MAX for size, end in zip(sizes, ends, strict=True)]
        malformed += keep.count(False)
        starts = list(compress(starts, keep))
        ends = list(compress(ends, keep))
        raw_names = tuple(compress(raw_names, keep))
    names = SHARED_NAMES.share(list(map(bytes.decode, raw_names, repeat("utf-8"),
                                        repeat("replace"))))
    return ParsedLines(array("Q", starts), array("Q", ends), names, malformed, long_lines)


def perf_map_path(pid: int, nstgid_innermost: int, proc_root: str = "/proc") -> str:
    """Path of a process's perf map inside its own mount namespace.

    Always below ``/proc/PID/root``: a containerised process writes into
    its own ``/tmp``, and the host's ``/tmp/perf-<nstgid>.map`` (if any)
    belongs to some other process.
    """
    path, root = process_tmp_file(
        pid, PerfMap.FILE_NAME.format(checked_pid(nstgid_innermost)), proc_root)
    return f"{root}/{path}"


class PerfMap(ProcessTmpFile):
    """Incremental, hardened reader of one perf map file.

    ``root`` (see :func:`tramprof.symbols.safeopen.open_untrusted`) makes
    ``path`` resolve below it without following symlinks; prefer
    :meth:`for_process`, which sets both.  Entries from a file that later
    becomes unreadable are kept until it is replaced.  A last line without
    its newline is not used until the newline arrives.  Not thread-safe:
    lookups build the index lazily, so refresh and look up from one thread.

    Caps: ``max_file_bytes`` (bytes of the file ever read; the rest is
    ignored and reported in ``bytes_capped``), ``max_line_bytes`` (longer
    lines are skipped), ``max_entries`` (entries kept from one file).

    With ``on_entries`` the reader keeps no index: each block of new entries
    is handed to it once, in file order (for readers that only follow what
    is appended, such as scan mode looking for new stub arenas).
    """

    FILE_NAME = "perf-{}.map"

    def __init__(
        self,
        path: str,
        expected_uid: int | None,
        *,
        root: str | None = None,
        not_before_ns: int | None = None,
        max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_entries: Callable[[ParsedLines], None] | None = None,
    ) -> None:
        if max_line_bytes <= 0 or max_entries < 0:
            raise ValueError("max_line_bytes must be positive, max_entries >= 0")
        self.stats = PerfMapStats()
        self._tail = TailReader(path, expected_uid, max_file_bytes, self.stats, root=root,
                                not_before_ns=not_before_ns, skip_stale_prefix=True)
        self._index: AddrIndex[str] = AddrIndex()
        #: ``lookup(addr) -> str | None``: name of the newest entry covering
        #: ``addr``.  Bound straight to the index (it is cleared in place,
        #: never replaced) to save a call on the hot path.
        self.lookup: Callable[[int], str | None] = self._index.lookup
        self._max_line_bytes = max_line_bytes
        self._max_entries = max_entries
        # A chunk must be able to hold a whole line plus its newline.
        self._chunk_bytes = max(chunk_bytes, 2 * (max_line_bytes + 1))
        self._skipping = False
        self._name_bytes = 0
        self._on_entries = on_entries
        self._accepted = 0  # entries taken from the current file

    def memory_bytes(self) -> int:
        """Estimated memory held by the index (what the symbol budget counts)."""
        return self._index.added * ENTRY_BYTES + self._name_bytes


    def refresh(self, max_bytes: int | None = None) -> RefreshResult:
        """Read what was appended since the last refresh (or reload).

        ``max_bytes`` bounds the bytes read by this call (at least one chunk
        is read); the rest is picked up by later refreshes.
        """
        session = self._tail.open()
        if isinstance(session, Refusal):
            return RefreshResult(refused=session.reason)
        added = 0
        with session:
            if session.reset:
                self._index.clear()
                self._name_bytes = 0
                self._accepted = 0
                self._skipping = False
            try:
                for chunk in session.chunks(self._chunk_bytes, max_bytes):
                    used, n = self._consume(chunk)
                    added += n
                    session.commit(chunk, used)
            except OSError as err:
                refusal = self._tail.refuse(Refusal(IO_ERROR, f"read: {err}"))
                return RefreshResult(refused=refusal.reason, new_entries=added)
            remaining = session.remaining
        self.stats.entries = self._accepted
        return RefreshResult(
            reloaded=session.reloaded,
            bytes_read=session.read_bytes,
            new_entries=added,
            capped=session.capped,
            remaining=remaining,
        )

    def _consume(self, data: bytes) -> tuple[int, int]:
        """Parse the complete lines of ``data``; return (bytes used, entries)."""
        begin = 0
        if self._skipping:
            newline = data.find(b"\n")
            if newline < 0:
                return len(data), 0
            self._skipping = False
            begin = newline + 1
        last = data.rfind(b"\n", begin)
        end = last + 1 if last >= 0 else begin
        added = self._add_block(data[begin:end]) if end > begin else 0
        if len(data) - end > self._max_line_bytes:
            # The unfinished line is already too long: skip to its newline.
            self.stats.long_lines += 1
            self._skipping = True
            return len(data), added
        return end, added

    def _add_block(self, block: bytes) -> int:
        with gc_paused():
            parsed = parse_lines(block, self._max_line_bytes)
        stats = self.stats
        stats.malformed += parsed.malformed
        stats.long_lines += parsed.long_lines
        n = len(parsed.names)
        room = self._max_entries - self._accepted
        if n > room:
            keep = max(room, 0)
            stats.dropped_entries += n - keep
            n = keep
            parsed.starts = parsed.starts[:n]
            parsed.ends = parsed.ends[:n]
            del parsed.names[n:]
        if n:
            self._accepted += n
            stats.lines_parsed += n
            if self._on_entries is not None:
                self._on_entries(parsed)
            else:
                self._index.extend(parsed.starts, parsed.ends, parsed.names)
                self._name_bytes += sum(map(len, parsed.names))
        return n

    def lookup_range(self, addr: int) -> tuple[int, int, str] | None:
        """(start, end, name) of the visible part of the entry covering ``addr``."""
        return self._index.lookup_range(addr)

    def symbols(self) -> list[tuple[int, int, str]]:
        """Every visible range in address order."""
        return self._index.items()

    def take_changes(self) -> list[tuple[int, int]] | None:
        """Address ranges whose lookups may answer differently since the last
        call (None: any may); see ``AddrIndex.take_changes``."""
        return self._index.take_changes()

    def __len__(self) -> int:
        return len(self._index)
