r"""Parsing of ``/proc/PID/maps``: which object backs a user-space address.

The symbolizer needs, per address, the mapping's file, its file offset and
whether the memory is anonymous (JIT code), special (``[vdso]``) or backed by
a file that is no longer reachable by its path (deleted, memfd).

File names are the process's to choose, and the kernel escapes only ``\n``
in them: the file is read as bytes and split on ``b"\n"`` alone, so a name
with ``\r``, ``\x0b``, ``\x85`` or U+2028 stays inside its own line and can
never inject a mapping. Names keep undecodable bytes as surrogate escapes (so
the file can be opened again); every name shown to a person goes through
``display_name``. The whole file is capped at ``MAX_MAPS_BYTES``.
"""

from __future__ import annotations

import os
import re
from bisect import bisect_right
from collections.abc import Sequence
from itertools import islice
from operator import attrgetter
from typing import NamedTuple

from tramprof import speedups
from tramprof.model import ProcessGone, SymbolizationError
from tramprof.procfs.identity import read_proc_file, read_stat

_DELETED_SUFFIX = " (deleted)"
# Shared anonymous memory (MAP_SHARED|MAP_ANONYMOUS, SysV shm) shows up as a
# deleted file on the internal shmem mount; it is anonymous for our purposes.
_ANON_PREFIXES = ("[anon:", "[anon_shmem:", "//anon", "/dev/zero (deleted)", "/SYSV")
#: The most of a maps file read: 65,530 mappings (vm.max_map_count) of ~250
#: bytes. A process with more (or with huge names) is refused, not read.
MAX_MAPS_BYTES = 16 << 20
# Threads of a process whose main thread exited looked at for a running one
# (the task directory lists them oldest first; one is nearly always enough).
MAX_THREADS_LOOKED_AT = 64


def display_name(text: str) -> str:
    """``text`` as valid, printable UTF-8 for output: undecodable bytes
    (surrogate escapes) and control characters become backslash escapes."""
    safe = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if safe.isprintable():
        return safe
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 0x100
                   else f"\\u{ord(c):04x}" for c in safe)


class Mapping(NamedTuple):
    """One line of ``/proc/PID/maps``; ``end`` is exclusive.

    A tuple, not a frozen dataclass: a new process's maps are parsed at its
    first sample, and with tuples the whole parse takes about half as long.
    Mappings key the symbolizer's state per mapped object, by all their
    fields (tuple equality and hash).
    """

    start: int
    end: int
    perms: str
    offset: int
    dev_major: int
    dev_minor: int
    inode: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def is_exec(self) -> bool:
        return len(self.perms) > 2 and self.perms[2] == "x"

    @property
    def is_deleted(self) -> bool:
        """The backing file was unlinked; its path no longer opens it."""
        return self.path.endswith(_DELETED_SUFFIX)

    @property
    def is_memfd(self) -> bool:
        """Backed by a memfd: a real file, but reachable only via map_files."""
        return self.path.startswith("/memfd:")

    @property
    def is_anonymous(self) -> bool:
        """No backing object file: plain anonymous, named anonymous or shmem."""
        return self.path == "" or self.path.startswith(_ANON_PREFIXES)

    @property
    def is_anonymous_exec(self) -> bool:
        """Executable memory with no file behind it: typically JIT output."""
        return self.is_exec and self.is_anonymous

    @property
    def is_special(self) -> bool:
        """Kernel-provided region such as ``[vdso]``, ``[stack]`` or ``[heap]``."""
        return (
            self.path.startswith("[")
            and self.path.endswith("]")
            and not self.path.startswith(("[anon:", "[anon_shmem:"))
        )

    @property
    def is_vdso(self) -> bool:
        return self.path == "[vdso]"

    @property
    def is_file_backed(self) -> bool:
        """Backed by a file we can try to open (possibly only via map_files)."""
        return self.path.startswith("/") and not self.is_anonymous

    @property
    def file_path(self) -> str:
        """The path without the kernel's `` (deleted)`` annotation."""
        if self.is_deleted:
            return self.path[: -len(_DELETED_SUFFIX)]
        return self.path

    @property
    def basename(self) -> str:
        """Short object name for unsymbolized frames (``libc.so.6``, ``memfd:jit``)."""
        path = self.file_path
        return display_name(path.rsplit("/", 1)[-1] or path)

    @property
    def display_path(self) -> str:
        """The whole path, safe to show (metrics, folded, pprof, HTML)."""
        return display_name(self.path)

    def contains(self, addr: int) -> bool:
        return self.start <= addr < self.end


def parse_maps_line(line: str) -> Mapping:
    """Parse one maps line; raises ValueError if it is not in the kernel's format.

    The path is everything after the inode column and its padding (spaces
    only), so paths with spaces or any other character survive intact.
    """
    parts = line.rstrip("\n").split(" ", 5)
    if len(parts) == 6:
        parts[5] = parts[5].lstrip(" ")
        if not parts[5]:
            parts.pop()
    if len(parts) < 5:
        raise ValueError(f"malformed maps line: {line!r}")
    addr_range, perms, offset, dev, inode = parts[:5]
    start_s, sep, end_s = addr_range.partition("-")
    major_s, sep2, minor_s = dev.partition(":")
    if not sep or not sep2:
        raise ValueError(f"malformed maps line: {line!r}")
    start, end = int(start_s, 16), int(end_s, 16)
    if end < start:
        raise ValueError(f"malformed maps line (end < start): {line!r}")
    return Mapping(
        start=start,
        end=end,
        perms=perms,
        offset=int(offset, 16),
        dev_major=int(major_s, 16),
        dev_minor=int(minor_s, 16),
        inode=int(inode),
        path=parts[5] if len(parts) == 6 else "",
    )


#: One line exactly as the kernel prints it (lowercase hex, decimal inode);
#: the path is what follows the padding, any bytes but ``\n``.
_KERNEL_LINE = re.compile(
    rb"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) ([0-9]+)(?: +(.*))?$",
    re.MULTILINE)


def parse_maps(data: bytes | str) -> list[Mapping]:
    """Parse a whole maps file, sorted by start address. Lines end at
    ``\n`` only (see the module docstring).

    One pattern over the whole file (a new process's maps are read at its
    first sample: about 15% faster than line by line); a file with any line
    it does not match is parsed line by line, which says what is wrong."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogateescape")
    compiled = speedups.compiled
    if compiled is not None:
        parsed: list[Mapping] | None = compiled.parse_maps(data, Mapping)
        if parsed is not None:  # every line a kernel line: as below, a tenth of the time
            parsed.sort(key=attrgetter("start"))
            return parsed
    fields = _KERNEL_LINE.findall(data)
    mappings = [
        Mapping(int(start, 16), int(end, 16), perms.decode("ascii"), int(offset, 16),
                int(major, 16), int(minor, 16), int(inode),
                path.decode("utf-8", "surrogateescape"))
        for start, end, perms, offset, major, minor, inode, path in fields]
    whole_lines = data.count(b"\n") + (not data.endswith(b"\n") and bool(data))
    if len(mappings) != whole_lines or any(m.end < m.start for m in mappings):
        mappings = [parse_maps_line(line.decode("utf-8", "surrogateescape"))
                    for line in data.split(b"\n") if line.strip(b" ")]
    mappings.sort(key=attrgetter("start"))
    return mappings


def process_exited(pid: int, proc_root: str = "/proc") -> bool:
    """True when ``pid`` no longer exists or all its threads have exited (its
    memory is gone). A process whose main thread exited while others run is
    not: see ``memory_thread``."""
    try:
        return read_stat(pid, proc_root).is_dead
    except ProcessGone:
        return True
    except (OSError, ValueError):
        return False


def memory_thread(pid: int, proc_root: str = "/proc") -> int | None:
    """A running thread of ``pid`` when its main thread has exited and others
    run on, else None. The main thread's /proc entry then shows none of the
    process's memory (empty maps, no root, no map_files), while each other
    thread's entry under ``task`` shows it all but map_files."""
    try:
        if not read_stat(pid, proc_root).leader_exited:
            return None
        with os.scandir(f"{proc_root}/{pid}/task") as entries:
            tids = [int(e.name) for e in islice(entries, MAX_THREADS_LOOKED_AT)
                    if e.name.isdigit() and int(e.name) != pid]
    except (ProcessGone, OSError, ValueError):
        return None
    for tid in tids:
        try:
            if not read_stat(tid, f"{proc_root}/{pid}/task").leader_exited:
                return tid  # its own state: running or sleeping
        except (ProcessGone, OSError, ValueError):
            continue
    return None


def read_maps(pid: int, proc_root: str = "/proc") -> list[Mapping]:
    """Read and parse ``{proc_root}/{pid}/maps``.

    Raises ProcessGone when the process vanished (before or while reading);
    PermissionError is passed through. A kernel thread has an empty list.
    """
    text = read_proc_file(pid, "maps", proc_root, limit=MAX_MAPS_BYTES + 1)
    if len(text) > MAX_MAPS_BYTES:
        raise SymbolizationError(f"{proc_root}/{pid}/maps is larger than {MAX_MAPS_BYTES} "
                                 "bytes")
    if not text and process_exited(pid, proc_root):
        # The mm is released before the /proc entry goes away.
        raise ProcessGone(pid, "exited while its maps were read")
    try:
        return parse_maps(text)
    except ValueError as e:
        raise SymbolizationError(f"{proc_root}/{pid}/maps: {e}") from e


def find_mapping(mappings: Sequence[Mapping], addr: int) -> Mapping | None:
    """The mapping containing ``addr`` in a start-sorted sequence, else None."""
    i = bisect_right(mappings, addr, key=attrgetter("start")) - 1
    if i >= 0 and addr < mappings[i].end:
        return mappings[i]
    return None
