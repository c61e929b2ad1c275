"""Symbol tables from the separate debug files of stripped objects.

Distributions strip ``.symtab`` from what they ship and put it, with the
DWARF, in a debug file (Debian's ``*-dbg``/``*-dbgsym`` packages), so without
it a stripped library names only its exported functions and everything else
prints as ``libc.so.6+0x27249``. Where gdb and perf look, we look:

- by build id: ``/usr/lib/debug/.build-id/xx/yyyy.debug``;
- by ``.gnu_debuglink`` (a file name and the CRC-32 of the debug file): in the
  object's directory, its ``.debug/`` subdirectory and
  ``/usr/lib/debug/<directory>/``;

first inside the process's root (``/proc/PID/root``: a container's own debug
files), then in the host's. Everything below a process's root is the
process's to choose, so files are opened through ``safeopen`` (no symlink
anywhere below the root, never blocking, regular files only), a debuglink
must be a plain file name, a file larger than ``max_file_bytes`` is not read,
and a candidate must prove it belongs to the object: the same build id, and
for a debuglink also the CRC. A refused candidate is reported with its reason
and the next one is tried.

Loaded tables are shared by every process whose object has that build id,
per root (one container's debug file never names another's frames), and
take part in the symbol memory budget: an evicted table is not loaded again
for ``evicted_backoff`` seconds. A lookup that found nothing is repeated
after ``retry_after`` seconds (a debug package may be installed meanwhile).
"""

from __future__ import annotations

import io
import os
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from tramprof.symbols.elf import ElfSymbols, read_build_id
from tramprof.symbols.errors import ElfError
from tramprof.symbols.safeopen import IO_ERROR, MISSING, Refusal, SafeFile, open_untrusted

DEBUG_DIR: Final = "usr/lib/debug"
#: Debug files of large C++ programs reach a few hundred MiB; a larger file
#: (or a sparse one claiming to be) is not read: a debuglink's CRC covers all of it.
MAX_DEBUG_FILE_BYTES: Final = 1 << 30
_CRC_CHUNK: Final = 1 << 20
_NAME_MAX: Final = 255

# Refusal reasons besides safeopen's (missing candidates are not refusals).
#: A debuglink that is not a plain file name (``../../etc/shadow``).
OUTSIDE: Final = "outside"
TOO_LARGE: Final = "too_large"
BUILD_ID_MISMATCH: Final = "build_id_mismatch"
CRC_MISMATCH: Final = "crc_mismatch"
NOT_ELF: Final = "not_elf"
MALFORMED_ELF: Final = "malformed_elf"


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A place a debug file may be: a path below a root, and how it is checked."""

    root: str
    path: str
    by_debuglink: bool


class _SafeStream(io.RawIOBase):
    """A ``SafeFile`` as the seekable stream pyelftools reads: never past its limit."""

    def __init__(self, safe: SafeFile) -> None:
        super().__init__()
        self._safe = safe
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        data = self._safe.read_at(self._pos, len(buffer))
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._safe.limit}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos


class DebugTable:
    """One loaded debug file's symbols, shared by every object with its build id.

    Has the interface the symbol memory budget evicts by (``note_use``,
    ``memory_bytes``, ``evict``), like a process's perf map index.
    """

    def __init__(self, symbols: ElfSymbols, candidate: _Candidate, expected: ElfSymbols,
                 info: DebugInfo) -> None:
        self._symbols: ElfSymbols | None = symbols
        self._candidate = candidate
        self._expected = expected
        self._info = info
        self.lookups = 0
        self._lookups_seen = 0
        self.last_used = info.clock()
        self._evicted_until: float | None = None
        self.evictions = 0

    def __str__(self) -> str:
        return f"the debug symbols of {self._expected.build_id or self._candidate.path}"

    @property
    def location(self) -> str:
        """Where the debug file was found (root and path below it)."""
        return os.path.join(self._candidate.root, self._candidate.path)

    def symbols(self) -> ElfSymbols | None:
        """The table, reloaded after an eviction once the back-off has passed."""
        self.lookups += 1
        if self._symbols is None:
            if self._evicted_until is not None and self._info.clock() < self._evicted_until:
                return None
            self._evicted_until = None
            loaded = self._info.load(self._candidate, self._expected)
            if isinstance(loaded, ElfSymbols):
                self._symbols = loaded
            else:  # gone or changed since: try again after another back-off
                self._evicted_until = self._info.clock() + self._info.evicted_backoff
        return self._symbols

    def note_use(self) -> float:
        """Move ``last_used`` to now if there were lookups since the last call."""
        if self.lookups != self._lookups_seen:
            self._lookups_seen = self.lookups
            self.last_used = self._info.clock()
        return self.last_used

    def memory_bytes(self) -> int:
        return self._symbols.memory_bytes() if self._symbols is not None else 0

    def evict(self) -> None:
        """Drop the table (the symbol memory budget is used up)."""
        self._symbols = None
        self._evicted_until = self._info.clock() + self._info.evicted_backoff
        self.evictions += 1


@dataclass(frozen=True, slots=True)
class DebugLookup:
    """What looking for an object's debug file gave: the table, if one was
    found, and the reasons candidates were refused (for the failure counters)."""

    table: DebugTable | None
    refused: tuple[str, ...] = ()


@dataclass(slots=True)
class _NotFound:
    until: float


class DebugInfo:
    """Finds, verifies and caches debug files; shared by all symbolizers."""

    def __init__(self, host_root: str = "/", *, max_file_bytes: int = MAX_DEBUG_FILE_BYTES,
                 max_entries: int = 1024, retry_after: float = 600.0,
                 evicted_backoff: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.host_root = host_root
        self.max_file_bytes = max_file_bytes
        self.max_entries = max_entries
        self.retry_after = retry_after
        self.evicted_backoff = evicted_backoff
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[int, int, str], DebugTable | _NotFound] = OrderedDict()
        #: Debug files read (parsed) so far, reloads after evictions included.
        self.loads = 0

    def tables(self) -> list[DebugTable]:
        """Every loaded (or evicted) table, for the memory budget."""
        with self._lock:
            return [e for e in self._entries.values() if isinstance(e, DebugTable)]

    def find(self, obj: ElfSymbols, object_path: str | None,
             process_root: str | None = None) -> DebugLookup:
        """The debug table of ``obj`` (mapped from ``object_path`` as the process
        sees it, below ``process_root``), or why there is none.

        Objects with a ``.symtab`` of their own, and objects with neither a
        build id nor a debuglink, need no lookup.
        """
        if obj.has_symtab or (obj.build_id is None and obj.debuglink is None):
            return DebugLookup(None)
        roots: list[tuple[tuple[int, int], str]] = []
        for root in (process_root, self.host_root):
            if root is None:
                continue
            try:
                st = os.stat(root)
            except OSError:
                continue
            identity = (st.st_dev, st.st_ino)
            if all(identity != seen for seen, _ in roots):
                roots.append((identity, root))
        refused: list[str] = []
        link_usable = obj.debuglink is not None and _plain_file_name(obj.debuglink.name)
        for (dev, ino), root in roots:
            key = (dev, ino, self._object_key(obj, object_path))
            with self._lock:
                entry = self._entries.get(key)
                if entry is not None:
                    self._entries.move_to_end(key)
            if isinstance(entry, DebugTable):
                return DebugLookup(entry, tuple(refused))
            if entry is not None and self.clock() < entry.until:
                continue
            if obj.debuglink is not None and not link_usable and OUTSIDE not in refused:
                refused.append(OUTSIDE)
            table = self._probe(obj, object_path if link_usable else None, root, refused)
            with self._lock:
                self._entries[key] = table or _NotFound(self.clock() + self.retry_after)
                self._entries.move_to_end(key)
                while len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            if table is not None:
                return DebugLookup(table, tuple(refused))
        return DebugLookup(None, tuple(refused))

    @staticmethod
    def _object_key(obj: ElfSymbols, object_path: str | None) -> str:
        if obj.build_id:
            return f"build-id:{obj.build_id}"
        assert obj.debuglink is not None
        return f"debuglink:{object_path}:{obj.debuglink.name}:{obj.debuglink.crc:08x}"

    def _probe(self, obj: ElfSymbols, object_path: str | None, root: str,
               refused: list[str]) -> DebugTable | None:
        for candidate in self._candidates(obj, object_path, root):
            loaded = self.load(candidate, obj)
            if isinstance(loaded, ElfSymbols):
                if len(loaded) == 0:  # a debug file without a symbol table names nothing
                    continue
                return DebugTable(loaded, candidate, obj, self)
            if loaded != MISSING:
                refused.append(loaded)
        return None

    @staticmethod
    def _candidates(obj: ElfSymbols, object_path: str | None, root: str) -> list[_Candidate]:
        """Build-id path first, then the debuglink's places (``object_path`` is
        None when the debuglink is not to be followed)."""
        out: list[_Candidate] = []
        bid = obj.build_id
        if bid and len(bid) > 2:
            out.append(_Candidate(root, f"{DEBUG_DIR}/.build-id/{bid[:2]}/{bid[2:]}.debug",
                                  by_debuglink=False))
        link = obj.debuglink
        if link is None or not object_path or not object_path.startswith("/"):
            return out
        name = link.name
        directory = os.path.dirname(object_path).strip("/")
        prefix = f"{directory}/" if directory else ""
        for path in (f"{prefix}{name}", f"{prefix}.debug/{name}",
                     f"{DEBUG_DIR}/{prefix}{name}"):
            out.append(_Candidate(root, path, by_debuglink=True))
        return out

    def load(self, candidate: _Candidate, obj: ElfSymbols) -> ElfSymbols | str:
        """Open, verify and parse one candidate: its symbols, or a refusal reason."""
        try:
            opened = open_untrusted(candidate.path, None, self.max_file_bytes,
                                    root=candidate.root, allow_hardlinks=True)
        except ValueError:  # a path with '..' components: never below the root
            return OUTSIDE
        if isinstance(opened, Refusal):
            return opened.reason
        with opened:
            if opened.capped_bytes:
                return TOO_LARGE
            stream = io.BufferedReader(_SafeStream(opened), buffer_size=64 << 10)
            try:
                build_id = read_build_id(stream)
                if obj.build_id and build_id and build_id != obj.build_id:
                    return BUILD_ID_MISMATCH
                if not candidate.by_debuglink and build_id != obj.build_id:
                    return BUILD_ID_MISMATCH
                if candidate.by_debuglink:
                    assert obj.debuglink is not None
                    if _crc32(opened) != obj.debuglink.crc:
                        return CRC_MISMATCH
                symbols = ElfSymbols.from_file(stream)
            except ElfError as e:
                return NOT_ELF if e.reason == "not_elf" else MALFORMED_ELF
            except MemoryError:
                return MALFORMED_ELF
            except OSError:
                return IO_ERROR
        with self._lock:
            self.loads += 1
        return symbols


def _plain_file_name(name: str) -> bool:
    """A debuglink names a file next to the object, never a path."""
    return (bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name
            and len(os.fsencode(name)) <= _NAME_MAX)


def _crc32(safe: SafeFile) -> int:
    """CRC-32 (the debuglink's, zlib's) of the whole file, read in chunks."""
    crc = 0
    offset = 0
    while offset < safe.limit:
        chunk = safe.read_at(offset, _CRC_CHUNK)
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        offset += len(chunk)
    return crc
