"""Read a process's trampoline-runtime descriptor from outside it.

Finds the runtime extension in ``/proc/PID/maps``, looks the exported symbol
up in the extension's ELF ``.dynsym`` (read through ``/proc/PID/map_files`` or
``/proc/PID/root``, so it also works for processes in containers or chroots),
and reads the struct and the arena table through the one memory reader. Needs
the right to read the target's memory (same uid with ptrace access, or root).
Everything read is the target's to choose: counts are capped, arenas must be
ordered and disjoint, and any failure is one ``DescriptorError``.

The layout is ABI version 2 of ``trampolines/ABI.md`` (version 1, the same
struct without the duty-cycle fields, is still read); this module and the
runtime's ``src/tramprof.h`` must change together (a test checks them
against each other through cffi).
"""

from __future__ import annotations

import os
import re
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import BinaryIO

from elftools.common.exceptions import ELFError
from elftools.elf.elffile import ELFFile
from elftools.elf.sections import SymbolTableSection

from tramprof.model import SymbolizationError
from tramprof.procfs.maps import Mapping, read_maps
from tramprof.procfs.memory import MemoryReadError, OpenMemory, read_memory
from tramprof.symbols.safeopen import open_mapping
from tramprof.unwind.arenas import Arenas

MAGIC = b"TRAMPROF"
ABI_VERSION = 2
#: Versions this reader understands (1: no duty-cycle fields).
ABI_VERSIONS = (1, 2)
SYMBOL = "tramprof_descriptor"
#: Matches the runtime extension's path in /proc/PID/maps.
EXTENSION_RE = re.compile(r"/tramprof_trampolines/_runtime[^/]*\.so(?: \(deleted\))?$")


def is_runtime_extension(path: str) -> bool:
    """Whether a mapped path is the runtime extension's (``EXTENSION_RE``).
    A substring test first: every mapping of every new process is asked,
    and almost none is it (half the cost of the pattern alone)."""
    return "/tramprof_trampolines/_runtime" in path and EXTENSION_RE.search(path) is not None


# struct tramprof_descriptor, little-endian: 136 bytes in ABI 1, 184 in ABI 2.
_LAYOUT_V1 = struct.Struct("<8s6Iq2IiIQ2I2Q32s16s")
_DUTY = struct.Struct("<4I4Q")
_LAYOUT = struct.Struct(_LAYOUT_V1.format + _DUTY.format[1:])
DESCRIPTOR_SIZE = _LAYOUT.size
DESCRIPTOR_SIZE_V1 = _LAYOUT_V1.size
FIELDS = ("magic", "abi_version", "arch", "stub_size", "stub_stride", "stub_return_offset",
          "state", "tls_offset", "record_prev_offset", "record_self_offset",
          "record_fp_offset", "pid", "arenas_address", "arena_count", "arena_capacity",
          "stub_count", "generation", "runtime_version", "python_version")
DUTY_FIELDS = ("duty_ppm", "window_us", "paused", "reserved", "hook_calls", "off_ns",
               "paused_since_ns", "call_cost_ps")
#: Offsets (ABI 2) of the word a profiler writes and of the one BPF reads.
DUTY_PPM_OFFSET = DESCRIPTOR_SIZE_V1
PAUSED_OFFSET = DESCRIPTOR_SIZE_V1 + 8
DUTY_ALWAYS = 1_000_000
STATES = {0: "inactive", 1: "active", 2: "deactivated"}
ARCHES = {62: "x86_64", 183: "aarch64"}
#: Arena table entries read at most (the runtime allocates 64 KiB arenas, so
#: this is 256 MiB of stubs; a larger count is a lie).
MAX_ARENAS = 4096


class DescriptorError(Exception):
    """The process has no (readable, valid) tramprof descriptor."""


@dataclass(frozen=True)
class Descriptor:
    pid: int                      # the process it was read from
    address: int                  # where the struct lives in that process
    extension: str                # path of the runtime extension (as mapped)
    abi_version: int
    arch: int                     # ELF e_machine
    stub_size: int
    stub_stride: int
    stub_return_offset: int
    state: int
    tls_offset: int
    record_prev_offset: int
    record_self_offset: int
    record_fp_offset: int
    writer_pid: int
    arenas_address: int
    arena_capacity: int
    stub_count: int
    generation: int
    runtime_version: str
    python_version: str
    arenas: Arenas
    duty: DutyState | None = None   # ABI 2 and later


    @property
    def active(self) -> bool:
        return self.state == 1


@dataclass(frozen=True)
class DutyState:
    """The duty-cycle words of an ABI 2 descriptor (ABI.md section 8)."""

    duty_ppm: int          # share of time the hook is on, millionths (0: always)
    paused: bool           # the hook is off right now
    hook_calls: int        # Python calls made through stubs so far
    off_ns: int            # time paused (closed pauses), CLOCK_MONOTONIC
    paused_since_ns: int   # start of the current pause, 0 when on
    call_cost_ps: int      # measured extra cost of one call through the hook


def read_duty(pid: int, address: int, proc_root: str = "/proc") -> DutyState:
    """The duty-cycle words alone (one small read per drain)."""
    return _duty(_read_mem(pid, address + DESCRIPTOR_SIZE_V1, _DUTY.size, proc_root))


#: The generation word and, in ABI 2, everything up to the end of the duty words.
_GENERATION_OFFSET = 80
_GENERATION = struct.Struct("<Q")


@dataclass(frozen=True)
class Changes:
    """What one small read says about a descriptor read before."""

    generation: int
    duty: DutyState | None     # ABI 2 and later


def read_changes(pid: int, known: Descriptor, proc_root: str = "/proc",
                 memory: OpenMemory | None = None) -> Changes:
    """The generation and duty words of a descriptor already read, in one read:
    unless the generation moved, nothing else needs reading (once a second for
    every Python process on a node, this is most of what is read: through
    ``memory``, a file kept open, when given)."""
    end = DESCRIPTOR_SIZE if known.duty is not None else _GENERATION_OFFSET + _GENERATION.size
    raw = _read_mem(pid, known.address + _GENERATION_OFFSET, end - _GENERATION_OFFSET,
                    proc_root, memory)
    (generation,) = _GENERATION.unpack_from(raw)
    duty = _duty(raw, DESCRIPTOR_SIZE_V1 - _GENERATION_OFFSET) if known.duty is not None \
        else None
    return Changes(generation, duty)


def _duty(raw: bytes, offset: int = 0) -> DutyState:
    """The duty-cycle words at ``offset`` of ``raw``."""
    values = dict(zip(DUTY_FIELDS, _DUTY.unpack_from(raw, offset), strict=True))
    return DutyState(duty_ppm=values["duty_ppm"], paused=bool(values["paused"]),
                     hook_calls=values["hook_calls"], off_ns=values["off_ns"],
                     paused_since_ns=values["paused_since_ns"],
                     call_cost_ps=values["call_cost_ps"])


def _dynsym_value(f: BinaryIO, name: str) -> tuple[int, int] | None:
    """(st_value of ``name`` in .dynsym, p_vaddr of the PT_LOAD at file offset 0)."""
    try:
        elf = ELFFile(f)
        dynsym = elf.get_section_by_name(".dynsym")
        symbols = dynsym.get_symbol_by_name(name) if isinstance(dynsym, SymbolTableSection) \
            else None
        base = next((seg["p_vaddr"] for seg in elf.iter_segments()
                     if seg["p_type"] == "PT_LOAD" and seg["p_offset"] == 0), None)
    except (ELFError, struct.error, ValueError, RecursionError) as exc:
        raise DescriptorError(f"the runtime extension is not a readable ELF file: {exc}") from exc
    if not symbols or base is None:
        return None
    return int(symbols[0]["st_value"]), int(base)


def _open_extension(pid: int, mapping: Mapping, proc_root: str) -> BinaryIO:
    """The extension the process mapped, as it sees it (``open_mapping``)."""
    errors: list[str] = []
    opened = open_mapping(f"{proc_root}/{pid}", mapping, errors)
    if opened is None:
        raise DescriptorError("cannot read the runtime extension: " + "; ".join(errors))
    return opened


def _read_mem(pid: int, address: int, size: int, proc_root: str = "/proc",
              memory: OpenMemory | None = None) -> bytes:
    try:
        if memory is not None:
            return memory.read(pid, address, size)
        return read_memory(pid, address, size, proc_root)
    except MemoryReadError as exc:
        raise DescriptorError(str(exc)) from exc


# (st_dev, st_ino, st_size, st_mtime_ns) of an extension file.
_FileKey = tuple[int, int, int, int]


class DescriptorLocator:
    """Where each process's descriptor is, found once and then read in place.

    Finding it means parsing the process's maps and the runtime extension's
    symbol table; a daemon that refreshes a hundred runtimes every second
    spent most of its time doing that again. An address is kept until what
    is there stops reading as a descriptor (then it is looked up afresh), or
    the process is forgotten; the symbol's value is kept per extension file,
    so all the processes of one runtime parse its symbol table once.
    """

    def __init__(self, max_files: int = 64, proc_root: str = "/proc") -> None:
        self.max_files = max_files
        #: The processes' memory, held open for ``read_changes``.
        self.memory = OpenMemory(proc_root)
        self._by_pid: dict[int, tuple[int, str]] = {}
        self._symbols: OrderedDict[_FileKey, tuple[int, int] | None] = OrderedDict()

    def known(self, pid: int) -> tuple[int, str] | None:
        return self._by_pid.get(pid)

    def remember(self, pid: int, found: tuple[int, str]) -> None:
        self._by_pid[pid] = found

    def forget(self, pid: int) -> None:
        self._by_pid.pop(pid, None)
        self.memory.forget(pid)

    def symbol(self, f: BinaryIO) -> tuple[int, int] | None:
        """``_dynsym_value`` of the opened extension, parsed once per file."""
        st = os.fstat(f.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in self._symbols:
            self._symbols.move_to_end(key)
            return self._symbols[key]
        found = _dynsym_value(f, SYMBOL)
        self._symbols[key] = found
        while len(self._symbols) > self.max_files:
            self._symbols.popitem(last=False)
        return found


def find_descriptor_address(pid: int, proc_root: str = "/proc",
                            locator: DescriptorLocator | None = None,
                            mappings: Sequence[Mapping] | None = None) -> tuple[int, str]:
    """(address of tramprof_descriptor in *pid*, extension path), from
    ``mappings`` when the caller has just read them (a read of an
    interpreter's maps is a few hundred microseconds)."""
    if mappings is None:
        try:
            mappings = read_maps(pid, proc_root)
        except (OSError, SymbolizationError) as exc:
            raise DescriptorError(f"cannot read the maps of process {pid}: {exc}") from exc
    by_path: dict[str, list[Mapping]] = {}
    for mapping in mappings:
        if is_runtime_extension(mapping.path):
            by_path.setdefault(mapping.path, []).append(mapping)
    if not by_path:
        raise DescriptorError(f"process {pid} has not loaded tramprof_trampolines")
    for path, maps in by_path.items():
        with _open_extension(pid, min(maps, key=lambda m: m.start), proc_root) as f:
            found = locator.symbol(f) if locator is not None else _dynsym_value(f, SYMBOL)
        base_maps = [m for m in maps if m.offset == 0]
        if found is None or not base_maps:
            continue
        value, base_vaddr = found
        # Load bias: the mapping of file offset 0 minus its PT_LOAD's page address.
        bias = min(m.start for m in base_maps) - (base_vaddr & ~0xFFF)
        return bias + value, path
    raise DescriptorError(f"no {SYMBOL} symbol in the runtime extension of process {pid}")


def _cstr(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode(errors="replace")


def read_descriptor(pid: int, proc_root: str = "/proc",
                    locator: DescriptorLocator | None = None,
                    mappings: Sequence[Mapping] | None = None) -> Descriptor:
    """Read and validate the descriptor of process *pid* (at the address
    ``locator`` knows, if it still holds one; else found from ``mappings``,
    its maps just read, if given)."""
    if locator is None:
        return _read_at(pid, *find_descriptor_address(pid, proc_root, mappings=mappings),
                        proc_root)
    known = locator.known(pid)
    if known is not None:
        try:
            return _read_at(pid, *known, proc_root)
        except DescriptorError:
            locator.forget(pid)  # gone, or not a descriptor there any more: look again
    found = find_descriptor_address(pid, proc_root, locator, mappings)
    descriptor = _read_at(pid, *found, proc_root)
    locator.remember(pid, found)
    return descriptor


def _read_at(pid: int, address: int, path: str, proc_root: str) -> Descriptor:
    duty: DutyState | None = None
    for _attempt in range(5):
        raw = _read_mem(pid, address, DESCRIPTOR_SIZE_V1, proc_root)
        values = dict(zip(FIELDS, _LAYOUT_V1.unpack(raw), strict=True))
        if values["magic"] != MAGIC:
            raise DescriptorError(f"bad magic {values['magic']!r} at {address:#x} in "
                                  f"process {pid}")
        if values["abi_version"] not in ABI_VERSIONS:
            raise DescriptorError(f"unsupported descriptor ABI version {values['abi_version']} "
                                  f"(this reader: {', '.join(map(str, ABI_VERSIONS))})")
        if values["abi_version"] >= 2:
            duty = read_duty(pid, address, proc_root)
        count = min(values["arena_count"], values["arena_capacity"])
        if count > MAX_ARENAS:
            raise DescriptorError(f"process {pid} claims {count} arenas (at most "
                                  f"{MAX_ARENAS} are read)")
        arenas = Arenas()
        if count:
            raw = _read_mem(pid, values["arenas_address"], 16 * count, proc_root)
            try:
                arenas = Arenas(struct.unpack_from("<QQ", raw, 16 * i) for i in range(count))
            except ValueError as exc:
                raise DescriptorError(f"process {pid}'s arena table: {exc}") from exc
        # The writer publishes an arena entry before the count and bumps the
        # generation afterwards: re-read it to get a consistent snapshot.
        (generation,) = _GENERATION.unpack(
            _read_mem(pid, address + _GENERATION_OFFSET, _GENERATION.size, proc_root))
        if generation == values["generation"]:
            break
    return Descriptor(
        pid=pid, address=address, extension=path,
        abi_version=values["abi_version"], arch=values["arch"],
        stub_size=values["stub_size"], stub_stride=values["stub_stride"],
        stub_return_offset=values["stub_return_offset"], state=values["state"],
        tls_offset=values["tls_offset"], record_prev_offset=values["record_prev_offset"],
        record_self_offset=values["record_self_offset"],
        record_fp_offset=values["record_fp_offset"], writer_pid=values["pid"],
        arenas_address=values["arenas_address"], arena_capacity=values["arena_capacity"],
        stub_count=values["stub_count"], generation=values["generation"],
        runtime_version=_cstr(values["runtime_version"]),
        python_version=_cstr(values["python_version"]), arenas=arenas, duty=duty)


def read_chain(pid: int, descriptor: Descriptor, thread_pointer: int,
               limit: int = 4096) -> list[tuple[int, int]]:
    """Walk a thread's chain given its thread pointer (fs base on x86-64):
    [(record address, stub start)], innermost first. Stops at a record that
    is not above the previous one on the stack or whose stub is not in an
    arena (a torn read of a running thread)."""
    head_raw = _read_mem(pid, thread_pointer + descriptor.tls_offset, 8)
    (record,) = struct.unpack("<Q", head_raw)
    chain: list[tuple[int, int]] = []
    while record and len(chain) < limit:
        if chain and record <= chain[-1][0]:
            break
        (prev,) = struct.unpack("<Q", _read_mem(pid, record + descriptor.record_prev_offset, 8))
        (stub,) = struct.unpack("<Q", _read_mem(pid, record + descriptor.record_self_offset, 8))
        if stub not in descriptor.arenas:
            break
        chain.append((record, stub))
        record = prev
    return chain
