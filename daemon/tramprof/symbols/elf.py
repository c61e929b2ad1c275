"""ELF function symbols, build-ids and load segments, plus a bounded cache
(one job, over 400 lines: reading symbol tables from untrusted files).

pyelftools reads the headers, sections, segments and notes. The symbol
tables themselves are decoded with ``struct.iter_unpack`` on the raw section
bytes: pyelftools builds a dict per symbol (~20 us each), which is too slow
for binaries with hundreds of thousands of symbols, while the raw decode is
about twenty times faster.

An ``ElfSymbols`` keeps only what symbolization needs, as a flat table (an
``array('Q')`` of starts and their names packed (``symbols.names``), gaps
marked), the
build-id, the PT_LOAD segments and the ``.gnu_debuglink`` (where a stripped
object's separate debug file is); no pyelftools object outlives parsing.
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import threading
import weakref
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from elftools.common.exceptions import ELFError as _PyElfError
from elftools.elf.elffile import ELFFile

from tramprof.symbols.errors import ElfError
from tramprof.symbols.names import PackedNames

__all__ = ["DebugLink", "ElfCache", "ElfError", "ElfSymbols", "LoadSegment", "read_build_id"]

_ELF_MAGIC = b"\x7fELF"
_PF_X = 0x1
_SHF_ALLOC = 0x2
_SHF_COMPRESSED = 0x800
_SHN_UNDEF = 0
_SHN_LORESERVE = 0xFF00
_FUNC_TYPES = (2, 10)  # STT_FUNC, STT_GNU_IFUNC
_STB_LOCAL = 0
_STB_WEAK = 2
_NT_GNU_BUILD_ID = 3
#: Distinct file offsets whose executable span an object remembers: the
#: offsets processes map it at (one or two; more only from a process that
#: maps pieces of it on purpose: past the bound, worked out at each ask).
MAX_REMEMBERED_SPANS = 8
# A file is the process's to choose, sparse files cost nothing to make, and
# pyelftools builds a Python object per header: bound what one file may cost.
# Real binaries have tens of sections and a handful of segments; the largest
# symbol tables seen (browsers, LLVM) are tens of MiB.
MAX_SECTIONS = 4096
MAX_SEGMENTS = 1024
MAX_SYMBOL_TABLE_BYTES = 256 << 20
MAX_NOTE_BYTES = 64 << 10
MAX_SECTION_NAMES_BYTES = 1 << 20
#: A debuglink is a file name (at most NAME_MAX) and a CRC.
MAX_DEBUGLINK_BYTES = 256 + 8
# Bytes per table entry besides its packed name (symbols.names): its start.
_START_BYTES = 8

# Whatever a malformed file makes pyelftools (or our own decoding) throw.
# OSError is deliberately absent: an unreadable file is a different failure.
_PARSE_ERRORS: tuple[type[BaseException], ...] = (
    _PyElfError,
    struct.error,
    ValueError,
    IndexError,
    KeyError,
    EOFError,
    TypeError,
    AssertionError,
    # pyelftools' construct recurses on some corrupted headers (found by fuzzing).
    RecursionError,
    ZeroDivisionError,
    UnicodeError,
    OverflowError,
    AttributeError,
)


@dataclass(frozen=True, slots=True)
class LoadSegment:
    """A PT_LOAD program header: how a file range maps to virtual addresses."""

    offset: int
    vaddr: int
    filesz: int
    memsz: int
    flags: int

    @property
    def executable(self) -> bool:
        return bool(self.flags & _PF_X)

    def contains_offset(self, offset: int) -> bool:
        return self.offset <= offset < self.offset + self.filesz


@dataclass(frozen=True, slots=True)
class DebugLink:
    """The ``.gnu_debuglink`` of a stripped object: its debug file's name and
    the CRC-32 of that file's contents."""

    name: str
    crc: int


@dataclass(slots=True)
class _Sym:
    value: int
    size: int
    shndx: int
    name: str
    rank: tuple[int, int, int, int, int, int]


class ElfSymbols:
    """Function symbols of one ELF object, addressed by ELF virtual address."""

    __slots__ = (
        "_memory",
        "_names",
        "_spans",
        "_starts",
        "build_id",
        "cache_key",
        "debuglink",
        "elf_class",
        "elf_type",
        "has_symtab",
        "machine",
        "segments",
        "symbol_count",
    )

    def __init__(
        self,
        *,
        build_id: str | None,
        elf_class: int,
        elf_type: str,
        machine: str,
        segments: tuple[LoadSegment, ...],
        starts: array[int],
        names: Iterable[str | None],
        has_symtab: bool = False,
        debuglink: DebugLink | None = None,
    ) -> None:
        self.build_id = build_id
        #: Function symbols came from a ``.symtab``: not stripped, no debug file needed.
        self.has_symtab = has_symtab
        self.debuglink = debuglink
        self.elf_class = elf_class
        self.elf_type = elf_type
        self.machine = machine
        self.segments = segments
        self._starts = starts
        self._names = PackedNames(names)
        self.symbol_count = self._names.count()
        self._memory: int | None = None
        # executable_span by file offset: every process mapping this object
        # asks for the same one or two.
        self._spans: dict[int, tuple[int, int, int] | None] = {}
        #: What the shared ``ElfCache`` knows this object by (its build id, or
        #: the file's identity), None outside it: names found in it are shared
        #: under this key (``ElfCache.shared_name``).
        self.cache_key: str | None = None

    @classmethod
    def from_path(cls, path: str | os.PathLike[str]) -> ElfSymbols:
        """Parse the file at ``path``; OSError if it cannot be opened or read."""
        with open(path, "rb") as f:
            return cls.from_file(f)

    @classmethod
    def from_file(cls, f: BinaryIO) -> ElfSymbols:
        """Parse a seekable binary file object (its position is not restored)."""
        return _parse(f)

    @classmethod
    def from_bytes(cls, data: bytes) -> ElfSymbols:
        """Parse an in-memory image, e.g. a process's ``[vdso]`` read from ``/proc/PID/mem``."""
        return _parse(io.BytesIO(data))

    def __len__(self) -> int:
        return self.symbol_count

    def memory_bytes(self) -> int:
        """Estimated memory of the symbol table (what a memory budget counts)."""
        if self._memory is None:
            self._memory = _START_BYTES * len(self._starts) + self._names.packed_bytes()
        return self._memory

    def executable_span(self, offset: int) -> tuple[int, int, int] | None:
        """The executable segment holding file ``offset``, when it is the
        only one holding any of its bytes: its file range ``[first, end)``
        and ``vaddr - file offset`` in it (``file_offset_to_vaddr`` of any
        offset in the range is one addition). None otherwise."""
        if offset in self._spans:
            return self._spans[offset]
        span = self._executable_span(offset)
        if len(self._spans) < MAX_REMEMBERED_SPANS:
            self._spans[offset] = span
        return span

    def _executable_span(self, offset: int) -> tuple[int, int, int] | None:
        holders = [seg for seg in self.segments if seg.executable and seg.filesz > 0]
        found = [seg for seg in holders if seg.contains_offset(offset)]
        if len(found) != 1:
            return None
        seg = found[0]
        end = seg.offset + seg.filesz
        if any(other is not seg and other.offset < end and seg.offset < other.offset + other.filesz
               for other in holders):
            return None
        return seg.offset, end, seg.vaddr - seg.offset

    def file_offset_to_vaddr(self, offset: int) -> int | None:
        """ELF virtual address of a file offset, via the PT_LOAD that maps it.

        When segments overlap in the file (old layouts without separate code
        pages), the executable one wins since we are symbolizing code.
        """
        found: LoadSegment | None = None
        for seg in self.segments:
            if seg.contains_offset(offset):
                if seg.executable:
                    return offset - seg.offset + seg.vaddr
                if found is None:
                    found = seg
        if found is None:
            return None
        return offset - found.offset + found.vaddr

    def resolve_vaddr(self, vaddr: int) -> str | None:
        """Name of the function containing ``vaddr``, or None."""
        i = bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        return self._names[i]


def read_build_id(f: BinaryIO) -> str | None:
    """Hex GNU build-id of an ELF file object, or None if it has none.

    Cheap (headers and notes only), which is what lets the cache recognise a
    binary it already parsed under another path or inode.
    """
    try:
        _check_magic(f)
        elf = ELFFile(f)
        return _build_id(elf)
    except _PARSE_ERRORS as e:
        raise ElfError(f"malformed ELF: {e}") from e


def _check_magic(f: BinaryIO) -> int:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0)
    head = f.read(4)
    f.seek(0)
    if size == 0:
        raise ElfError("empty file, not ELF", reason="not_elf")
    if head != _ELF_MAGIC:
        raise ElfError("not an ELF file (bad magic)", reason="not_elf")
    return size


def _parse(f: BinaryIO) -> ElfSymbols:
    size = _check_magic(f)
    try:
        return _parse_elf(ELFFile(f), size)
    except _PARSE_ERRORS as e:
        raise ElfError(f"malformed or truncated ELF: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class _Section:
    """A section header and a way to read its bytes.

    pyelftools' own section objects parse their contents when created (a
    hash section decodes its whole table), which made creating them the
    largest cost of loading a library; the headers are all we need.
    """

    header: Any
    stream: Any

    @property
    def name(self) -> str:
        return str(self.header["sh_name"])

    def data(self) -> bytes:
        if self.header["sh_type"] == "SHT_NOBITS":
            return b""
        self.stream.seek(self.header["sh_offset"])
        data: bytes = self.stream.read(self.header["sh_size"])
        return data


def _check_counts(elf: Any) -> None:
    if elf.num_sections() > MAX_SECTIONS:
        raise ElfError(f"{elf.num_sections()} section headers (at most {MAX_SECTIONS} are read)")
    if elf.num_segments() > MAX_SEGMENTS:
        raise ElfError(f"{elf.num_segments()} program headers (at most {MAX_SEGMENTS} are read)")


def _sections(elf: Any) -> list[_Section]:
    _check_counts(elf)
    read_header = getattr(elf, "_get_section_header", None)
    if read_header is None:  # a pyelftools without the private reader
        return [_Section(sec.header, elf.stream) for sec in elf.iter_sections()]
    return [_Section(read_header(i), elf.stream) for i in range(elf.num_sections())]


def _parse_elf(elf: Any, file_size: int) -> ElfSymbols:
    _check_counts(elf)
    segments = tuple(
        LoadSegment(
            offset=seg["p_offset"],
            vaddr=seg["p_vaddr"],
            filesz=seg["p_filesz"],
            memsz=seg["p_memsz"],
            flags=seg["p_flags"],
        )
        for seg in elf.iter_segments()
        if seg["p_type"] == "PT_LOAD"
    )
    sections = _sections(elf)
    build_id = _build_id(elf, sections)

    section_bounds: list[tuple[int, int] | None] = []
    for sec in sections:
        h = sec.header
        alloc = h["sh_flags"] & _SHF_ALLOC and h["sh_type"] != "SHT_NULL"
        section_bounds.append((h["sh_addr"], h["sh_addr"] + h["sh_size"]) if alloc else None)

    elf64 = elf.elfclass == 64
    endian = "<" if elf.little_endian else ">"
    thumb = elf["e_machine"] == "EM_ARM"
    syms: list[_Sym] = []
    # .symtab first: at equal address its names win over .dynsym's.
    for source, wanted in enumerate(("SHT_SYMTAB", "SHT_DYNSYM")):
        for sec in sections:
            if sec.header["sh_type"] == wanted:
                syms.extend(_read_symtab(sections, sec, file_size, elf64, endian, thumb,
                                         source))
    has_symtab = any(s.rank[0] == 0 for s in syms)

    starts, names = _build_table(syms, section_bounds, segments)
    return ElfSymbols(
        build_id=build_id,
        elf_class=elf.elfclass,
        elf_type=str(elf["e_type"]),
        machine=str(elf["e_machine"]),
        segments=segments,
        starts=starts,
        names=names,
        has_symtab=has_symtab,
        debuglink=_debuglink(elf, sections, file_size, endian),
    )


def _debuglink(elf: Any, sections: list[_Section], file_size: int,
               endian: str) -> DebugLink | None:
    """The ``.gnu_debuglink`` section: a NUL-terminated file name, padded to
    four bytes, then the CRC-32 of the debug file. None if absent or malformed."""
    shstrndx = elf["e_shstrndx"]
    if not 0 < shstrndx < len(sections):
        return None
    names_sec = sections[shstrndx]
    h = names_sec.header
    if (h["sh_type"] != "SHT_STRTAB" or h["sh_size"] > MAX_SECTION_NAMES_BYTES
            or h["sh_offset"] + h["sh_size"] > file_size):
        return None
    section_names = names_sec.data()
    for sec in sections:
        h = sec.header
        start = h["sh_name"]
        if section_names[start:start + 15] != b".gnu_debuglink\0":
            continue
        if (h["sh_type"] == "SHT_NOBITS" or h["sh_size"] > MAX_DEBUGLINK_BYTES
                or h["sh_offset"] + h["sh_size"] > file_size):
            return None
        data = sec.data()
        end = data.find(b"\0")
        crc_at = (end + 4) & ~3
        if end <= 0 or crc_at + 4 > len(data):
            return None
        (crc,) = struct.unpack_from(endian + "I", data, crc_at)
        return DebugLink(data[:end].decode("utf-8", "surrogateescape"), crc)
    return None


def _section_bytes(sec: _Section, file_size: int) -> bytes:
    h = sec.header
    if h["sh_type"] != "SHT_NOBITS" and h["sh_offset"] + h["sh_size"] > file_size:
        raise ElfError(f"truncated ELF: section {sec.name or '?'} extends past end of file")
    if h["sh_size"] > MAX_SYMBOL_TABLE_BYTES:
        raise ElfError(f"section {sec.name or '?'} of {h['sh_size']} bytes (at most "
                       f"{MAX_SYMBOL_TABLE_BYTES} are read)")
    return sec.data()


def _read_symtab(
    sections: list[_Section],
    sec: _Section,
    file_size: int,
    elf64: bool,
    endian: str,
    thumb: bool,
    source: int,
) -> list[_Sym]:
    h = sec.header
    entsize = h["sh_entsize"]
    layout = struct.Struct(endian + ("IBBHQQ" if elf64 else "IIIBBH"))
    if entsize < layout.size or h["sh_size"] == 0 or h["sh_flags"] & _SHF_COMPRESSED:
        return []
    if h["sh_link"] >= len(sections):
        return []
    strtab_sec = sections[h["sh_link"]]
    if strtab_sec.header["sh_type"] != "SHT_STRTAB":
        return []
    data = _section_bytes(sec, file_size)
    strtab = _section_bytes(strtab_sec, file_size)

    count = len(data) // entsize
    if entsize == layout.size:
        records = layout.iter_unpack(data[: count * entsize])
    else:
        records = (layout.unpack_from(data, i * entsize) for i in range(count))
    out: list[_Sym] = []
    for rec in records:
        if elf64:
            st_name, st_info, _other, shndx, value, size = rec
        else:
            st_name, value, size, st_info, _other, shndx = rec
        if (st_info & 0xF) not in _FUNC_TYPES or shndx == _SHN_UNDEF or value == 0:
            continue
        end = strtab.find(b"\0", st_name)
        if end <= st_name:  # empty name, or st_name beyond the string table
            continue
        name = strtab[st_name:end].decode("utf-8", "backslashreplace")
        if "@" in name[1:]:
            # A symbol version (__libc_start_main@@GLIBC_2.34) is not part of
            # the function's name: callers and flame graphs know it without.
            name = name[:name.index("@", 1)]
        if thumb:
            value &= ~1
        bind = st_info >> 4
        rank = (
            source,
            0 if size else 1,
            1 if bind == _STB_WEAK else 0,
            1 if bind == _STB_LOCAL else 0,
            len(name) - len(name.lstrip("_")),
            -len(name),
        )
        out.append(_Sym(value, size, shndx, name, rank))
    return out


def _build_table(
    syms: list[_Sym],
    section_bounds: list[tuple[int, int] | None],
    segments: tuple[LoadSegment, ...],
) -> tuple[array[int], list[str | None]]:
    """Flatten symbols into (start, name) with ``None`` entries closing gaps.

    Aliases at one address collapse to the best-ranked name. Sized symbols
    end at start+size; zero-size ones run to the next symbol, bounded by the
    end of their section (or segment) so the last one does not swallow
    everything after it.
    """
    best: dict[int, _Sym] = {}
    for s in syms:
        cur = best.get(s.value)
        if cur is None or s.rank < cur.rank:
            best[s.value] = s
    ordered = sorted(best.values(), key=lambda s: s.value)

    starts: array[int] = array("Q")
    names: list[str | None] = []
    for i, s in enumerate(ordered):
        nxt = ordered[i + 1].value if i + 1 < len(ordered) else None
        if s.size:
            end = s.value + s.size
        else:
            end = _container_end(s, section_bounds, segments)
            if nxt is not None:
                end = min(end, nxt)
        if names and names[-1] is None and starts[-1] == s.value:
            names[-1] = s.name  # a gap marker right where this symbol starts
        else:
            starts.append(s.value)
            names.append(s.name)
        if nxt is None or end < nxt:
            starts.append(max(end, s.value + 1))
            names.append(None)
    return starts, names


def _container_end(
    s: _Sym,
    section_bounds: list[tuple[int, int] | None],
    segments: tuple[LoadSegment, ...],
) -> int:
    if s.shndx < _SHN_LORESERVE and s.shndx < len(section_bounds):
        bounds = section_bounds[s.shndx]
        if bounds is not None and bounds[0] <= s.value < bounds[1]:
            return bounds[1]
    for seg in segments:
        if seg.vaddr <= s.value < seg.vaddr + seg.memsz:
            return seg.vaddr + seg.memsz
    return s.value + 1


def _build_id(elf: Any, sections: list[_Section] | None = None) -> str | None:
    """GNU build-id from note sections, or from PT_NOTE when sections are absent."""
    endian = "<" if elf.little_endian else ">"
    blobs: list[bytes] = []
    if sections is None:
        sections = _sections(elf)
    if sections:
        blobs.extend(s.data() for s in sections if s.header["sh_type"] == "SHT_NOTE"
                     and s.header["sh_size"] <= MAX_NOTE_BYTES)
    else:
        _check_counts(elf)
        blobs.extend(s.data() for s in elf.iter_segments() if s["p_type"] == "PT_NOTE"
                     and s["p_filesz"] <= MAX_NOTE_BYTES)
    for blob in blobs:
        found = _build_id_from_notes(blob, endian)
        if found:
            return found
    return None


def _build_id_from_notes(blob: bytes, endian: str) -> str | None:
    header = struct.Struct(endian + "III")
    pos = 0
    while pos + header.size <= len(blob):
        namesz, descsz, ntype = header.unpack_from(blob, pos)
        pos += header.size
        name_end = pos + namesz
        desc_start = (name_end + 3) & ~3
        desc_end = desc_start + descsz
        if desc_end > len(blob):
            return None
        if ntype == _NT_GNU_BUILD_ID and blob[pos:name_end].rstrip(b"\0") == b"GNU" and descsz:
            return blob[desc_start:desc_end].hex()
        pos = (desc_end + 3) & ~3
    return None


def stat_key(st: os.stat_result) -> str:
    """A file's identity while unchanged: device, inode, size, mtime."""
    return f"stat:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


#: Function names by (object, address) shared by all processes: enough for
#: the hot code of a few hundred objects; emptied when full.
MAX_SHARED_NAMES = 1 << 16


class ElfCache:
    """Bounded LRU of parsed ``ElfSymbols``, shared by all processes.

    Keyed by build-id when the binary has one (the same library in a hundred
    containers is parsed once), otherwise by (st_dev, st_ino, st_size,
    st_mtime_ns). A stat-identity alias index lets a repeat visit skip even
    reading the build-id. Files that failed to parse are remembered too (by
    stat identity) so a broken binary is not re-parsed for every process.

    The names found at addresses of its objects are shared too
    (``shared_name``): a hundred processes of one program each meet its
    addresses for the first time, and all but the first find the name there.
    A key names one object's content, so a name stays right after the
    object itself is evicted.
    """

    def __init__(self, max_entries: int = 512) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, ElfSymbols] = OrderedDict()
        self._aliases: OrderedDict[str, str] = OrderedDict()
        self._failures: OrderedDict[str, ElfError] = OrderedDict()
        # Files held open for a later parse, one per file however many
        # processes map it (a busy node held the same ld.so 200 times).
        self._held: weakref.WeakValueDictionary[str, BinaryIO] = weakref.WeakValueDictionary()
        self._names: dict[tuple[str, int], str] = {}
        self.hits = 0
        self.misses = 0

    def shared_name(self, obj: ElfSymbols, vaddr: int) -> str | None:
        """The name another process found at ``vaddr`` of ``obj``, if any."""
        key = obj.cache_key
        return self.shared_name_at(key, vaddr) if key is not None else None

    @property
    def shared_names(self) -> dict[tuple[str, int], str]:
        """The names ``share_name`` kept, by (object key, vaddr); only read
        through this (a full store is emptied in place, never replaced)."""
        return self._names

    def shared_name_at(self, key: str, vaddr: int) -> str | None:
        """``shared_name`` by the object's ``cache_key``."""
        return self._names.get((key, vaddr))

    def share_name(self, obj: ElfSymbols, vaddr: int, name: str) -> None:
        """Remember the final (demangled) name found at ``vaddr`` of ``obj``."""
        key = obj.cache_key
        if key is None:
            return
        names = self._names
        if len(names) >= MAX_SHARED_NAMES:
            names.clear()
        names[(key, vaddr)] = name

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._aliases.clear()
            self._failures.clear()
            self._names.clear()

    def get_path(self, path: str | os.PathLike[str]) -> ElfSymbols:
        """Symbols of the file at ``path``; raises OSError or ElfError."""
        with open(path, "rb") as f:
            return self.get_file(f)

    def hold(self, f: BinaryIO) -> BinaryIO | ElfSymbols:
        """Keep an open, not yet parsed file for later: the symbols if this
        exact file was parsed before (``f`` is closed), else the one open
        file every holder of it shares (``f`` itself, or ``f`` is closed and
        an earlier holder's file is returned). A shared file is closed when
        its last holder lets go of it; parse it with ``get_file``, never
        close it."""
        identity = stat_key(os.fstat(f.fileno()))
        with self._lock:
            found = self._known(identity)
            if found is None:
                self._held[identity] = f
                return f
        f.close()
        return found

    def known(self, st: os.stat_result) -> ElfSymbols | BinaryIO | None:
        """What ``hold`` would give for a file of this ``stat`` (the parsed
        symbols, or the one open file held for it), without a descriptor of
        it: a busy node's new processes map the same few objects, and not
        opening them again saves most of their warming. None: not known."""
        with self._lock:
            return self._known(stat_key(st))

    def _known(self, identity: str) -> ElfSymbols | BinaryIO | None:
        primary = self._aliases.get(identity)
        found = self._lookup(primary) if primary is not None else None
        return found if found is not None else self._held.get(identity)

    def get_file(self, f: BinaryIO) -> ElfSymbols:
        """Symbols of an open file; raises OSError or ElfError."""
        st = os.fstat(f.fileno())
        identity = stat_key(st)
        with self._lock:
            primary = self._aliases.get(identity)
            if primary is not None:
                cached = self._lookup(primary)
                if cached is not None:
                    self._aliases.move_to_end(identity)
                    return cached
            failure = self._failures.get(identity)
            if failure is not None:
                self.hits += 1
                raise ElfError(str(failure), reason=failure.reason)

        try:
            build_id = read_build_id(f)
            key = f"build-id:{build_id}" if build_id else identity
            with self._lock:
                cached = self._lookup(key)
                if cached is not None:
                    self._alias(identity, key)
                    return cached
            try:
                symbols = _parse(f)
            except MemoryError as e:  # cached like any other failure: never retried
                raise ElfError(f"parsing exhausted memory: {e}") from None
        except ElfError as e:
            with self._lock:
                self.misses += 1
                self._failures[identity] = e
                while len(self._failures) > self.max_entries:
                    self._failures.popitem(last=False)
            raise
        with self._lock:
            self.misses += 1
            self._insert(key, symbols)
            self._alias(identity, key)
        return symbols

    def get_image(self, data: bytes) -> ElfSymbols:
        """Symbols of an in-memory image, keyed by content hash (vdso is shared)."""
        key = "image:" + hashlib.blake2b(data, digest_size=20).hexdigest()
        with self._lock:
            cached = self._lookup(key)
            if cached is not None:
                return cached
        symbols = ElfSymbols.from_bytes(data)
        with self._lock:
            self.misses += 1
            self._insert(key, symbols)
        return symbols

    def _lookup(self, key: str) -> ElfSymbols | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return entry

    def _insert(self, key: str, symbols: ElfSymbols) -> None:
        symbols.cache_key = key
        self._entries[key] = symbols
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _alias(self, stat_key: str, key: str) -> None:
        self._aliases[stat_key] = key
        self._aliases.move_to_end(stat_key)
        while len(self._aliases) > 4 * self.max_entries:
            self._aliases.popitem(last=False)
