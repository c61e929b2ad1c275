"""The records a BPF program submits to a perf event array (``perf_submit``),
read straight from the kernel's per-CPU rings.

bcc's perf readers hand each record to a ctypes callback. The loop is woken
for every newly sampled process, and each wake went through that machinery
cache-cold: converting the arguments, taking the GIL again, casting the
record (~30 us a wake more than reading the rings directly, measured with
short-lived processes next to cache-thrashing ones). Here a wake costs two
reads of each ring's control page and a copy of the new bytes.

The ring (``struct perf_event_mmap_page``, include/uapi/linux/perf_event.h):
one control page, then ``pages`` pages of records that wrap around. The
kernel writes records, then advances ``data_head``; the reader reads
``data_head``, then (ordered after it) the records up to it, then (ordered
after them) stores ``data_tail``. The mapping is writable, so the kernel
never overwrites unread records: what does not fit is counted in a
``PERF_RECORD_LOST`` record instead. The compiled part orders these
accesses with acquire and release barriers; without it they are plain
reads and writes, which x86-64's memory order keeps in program order.
Elsewhere, a record could then be read before it is complete: at worst one
newly sampled process is warmed late or a stale one looked at, never a
crash (every length is checked against the ring).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import platform
import struct
from typing import Any, Final

from tramprof import speedups
from tramprof.sampler.loaded import libc, online_cpus

# perf_event_open by machine (arch/*/syscall tables; the generic table
# serves arm64 and riscv64).
_PERF_EVENT_OPEN: Final = {"x86_64": 298, "aarch64": 241, "riscv64": 241,
                           "ppc64le": 319, "s390x": 331}
_PERF_TYPE_SOFTWARE: Final = 1
_PERF_COUNT_SW_BPF_OUTPUT: Final = 10
_PERF_SAMPLE_RAW: Final = 1 << 10
_PERF_FLAG_FD_CLOEXEC: Final = 1 << 3
# struct perf_event_attr, first version (PERF_ATTR_SIZE_VER0): type, size,
# config, sample_period, sample_type, read_format, the flag bits,
# wakeup_events, bp_type, config1.
_ATTR: Final = struct.Struct("=IIQQQQQIIQ")
# Where the control page (struct perf_event_mmap_page) keeps data_head and
# data_tail; the compiled accesses take them from here.
DATA_HEAD: Final = 1024
DATA_TAIL: Final = 1032
_U64: Final = struct.Struct("=Q")
# struct perf_event_header: type, misc, size (records are 8-byte aligned,
# so a header never wraps around the ring's end).
_HEADER: Final = struct.Struct("=IHH")
_RECORD_LOST: Final = 2  # header, id, lost
_RECORD_SAMPLE: Final = 9  # header, with PERF_SAMPLE_RAW: u32 size, the bytes
_RAW_SIZE: Final = struct.Struct("=I")
_LOST: Final = struct.Struct("=8xQQ")


def _perf_event_open(cpu: int) -> int:
    """A BPF output event on ``cpu`` (every process) that wakes its poller
    at every record: a newly sampled process is looked at at once."""
    machine = platform.machine()
    number = _PERF_EVENT_OPEN.get(machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"perf_event_open: unknown machine {machine}")
    attr = ctypes.create_string_buffer(_ATTR.pack(
        _PERF_TYPE_SOFTWARE, _ATTR.size, _PERF_COUNT_SW_BPF_OUTPUT, 1, _PERF_SAMPLE_RAW, 0, 0,
        1, 0, 0), _ATTR.size)
    fd = libc().syscall(ctypes.c_long(number), attr, ctypes.c_int(-1), ctypes.c_int(cpu),
                        ctypes.c_int(-1), ctypes.c_ulong(_PERF_FLAG_FD_CLOEXEC))
    if fd < 0:
        code = ctypes.get_errno() or errno.EIO
        raise OSError(code, f"cannot open a perf ring on CPU {cpu}: {os.strerror(code)}")
    return int(fd)


class PerfRing:
    """One CPU's ring of BPF output records."""

    def __init__(self, cpu: int, pages: int) -> None:
        if pages <= 0 or pages & (pages - 1):
            raise ValueError(f"a perf ring has a power of two of pages, not {pages}")
        self.cpu = cpu
        self.fd = _perf_event_open(cpu)
        page = mmap.PAGESIZE
        self._size = pages * page
        try:
            self._map = mmap.mmap(self.fd, page + self._size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._view = memoryview(self._map)
        self._data = self._view[page:]
        self._tail = _U64.unpack_from(self._view, DATA_TAIL)[0]
        #: Records whose length did not fit the ring: the rest of what was
        #: there was skipped (it cannot happen with a kernel's own records).
        self.malformed = 0

    def read(self) -> tuple[list[bytes], int]:
        """The samples' bytes written since the last read, oldest first,
        and how many records the kernel counted as lost meanwhile."""
        compiled = speedups.compiled
        head = compiled.ring_head(self._map, DATA_HEAD) if compiled is not None \
            else _U64.unpack_from(self._view, DATA_HEAD)[0]
        tail = self._tail
        if head == tail:
            return [], 0
        data, size = self._data, self._size
        samples: list[bytes] = []
        lost = 0
        while tail < head:
            at = tail & (size - 1)
            kind, _misc, length = _HEADER.unpack_from(data, at)
            if length < _HEADER.size or length > head - tail:
                self.malformed += 1
                tail = head
                break
            end = at + length
            record = bytes(data[at:end]) if end <= size \
                else bytes(data[at:]) + bytes(data[:end - size])
            if kind == _RECORD_SAMPLE and length >= _HEADER.size + _RAW_SIZE.size:
                raw = _RAW_SIZE.unpack_from(record, _HEADER.size)[0]
                first = _HEADER.size + _RAW_SIZE.size
                samples.append(record[first:first + raw])
            elif kind == _RECORD_LOST and length >= _LOST.size:
                lost += _LOST.unpack_from(record, 0)[1]
            tail += length
        self._tail = tail
        if compiled is not None:
            compiled.ring_tail(self._map, DATA_TAIL, tail)
        else:
            _U64.pack_into(self._view, DATA_TAIL, tail)
        return samples, lost

    def close(self) -> None:
        if self.fd < 0:
            return
        self._data.release()
        self._view.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1


def open_rings(table: Any, pages: int) -> list[PerfRing]:
    """A ring on each online CPU, put in the perf event array ``table``
    (bcc's or ``sampler.loaded``'s) at its CPU: all or none."""
    rings: list[PerfRing] = []
    try:
        for cpu in online_cpus():
            ring = PerfRing(cpu, pages)
            rings.append(ring)
            table[table.Key(cpu)] = table.Leaf(ring.fd)
    except BaseException:
        close_rings(table, rings)
        raise
    return rings


def close_rings(table: Any | None, rings: list[PerfRing]) -> None:
    """Take the rings out of ``table`` (None: it is gone), then close them."""
    for ring in rings:
        if table is not None:
            with contextlib.suppress(KeyError, IndexError, OSError):
                del table[table.Key(ring.cpu)]
        ring.close()
