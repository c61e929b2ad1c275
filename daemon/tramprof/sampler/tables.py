"""Unwind tables in the BPF maps: row chunks and per-process mapping lists.

Rows of every loaded object live in one global row space made of chunks:
each chunk is its own BPF array map of ``UNWIND_CHUNK_ROWS`` rows (32 KiB),
placed in a slot of the ``unwind_chunks`` array-of-maps. An object takes a
run of consecutive slots, so its rows are contiguous for the walker's binary
search, while memory is only spent on chunks that exist: an empty slot is a
null pointer. There are more slots than the memory budget can fill, so freed
runs never need compacting. Chunks are written with one batch update each.

Chunks are created directly while the daemon holds CAP_BPF, and by the
``chunkmaker`` child after it dropped it. This is the only writer of
``unwind_chunks`` and ``unwind_procs``; what to load and when to evict is
``unwind.tables``' decision.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Sequence
from typing import Any

from tramprof.sampler import layout
from tramprof.sampler.btf import libbpf
from tramprof.sampler.chunkmaker import create_chunk_map

ROW_BYTES = ctypes.sizeof(layout.UnwindRow)
CHUNK_BYTES = layout.UNWIND_CHUNK_ROWS * ROW_BYTES
PROC_BYTES = ctypes.sizeof(layout.UnwindProc)


class TablesFull(Exception):
    """No run of free chunk slots is long enough (the caller evicts and retries)."""


def chunks_for(rows: int) -> int:
    return -(-rows // layout.UNWIND_CHUNK_ROWS)


class UnwindTableMaps:
    """Loads and unloads row runs and writes process mapping lists."""

    def __init__(self, bpf: Any, slots: int, maker: Callable[[], int] | None = None) -> None:
        self._bpf = bpf
        self._maker = maker
        self.slots = slots
        self._outer_fd = int(bpf[b"unwind_chunks"].map_fd)
        self._procs = bpf.get_table(b"unwind_procs", keytype=ctypes.c_uint32,
                                    leaftype=layout.UnwindProc)
        self._free: list[tuple[int, int]] = [(0, slots)]  # (first slot, count), sorted
        self._runs: dict[int, int] = {}                    # first row -> slots
        lib = libbpf()
        lib.bpf_map_update_batch.restype = ctypes.c_int
        lib.bpf_map_update_batch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                             ctypes.POINTER(ctypes.c_uint32), ctypes.c_void_p]
        lib.bpf_map_update_elem.restype = ctypes.c_int
        lib.bpf_map_update_elem.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                            ctypes.c_uint64]
        lib.bpf_map_delete_elem.restype = ctypes.c_int
        lib.bpf_map_delete_elem.argtypes = [ctypes.c_int, ctypes.c_void_p]
        self._lib = lib
        self._keys = (ctypes.c_uint32 * layout.UNWIND_CHUNK_ROWS)(
            *range(layout.UNWIND_CHUNK_ROWS))

    @property
    def chunks_loaded(self) -> int:
        return sum(self._runs.values())

    def load(self, rows: bytes) -> int:
        """Put packed rows into a fresh run of chunks; returns its first row."""
        count = len(rows) // ROW_BYTES
        need = chunks_for(count)
        first = self._take(need)
        try:
            for i in range(need):
                part = rows[i * CHUNK_BYTES:(i + 1) * CHUNK_BYTES]
                self._install_chunk(first + i, part)
        except OSError:
            self._clear(first, need)
            self._give(first, need)
            raise
        self._runs[first * layout.UNWIND_CHUNK_ROWS] = need
        return first * layout.UNWIND_CHUNK_ROWS

    def unload(self, first_row: int) -> None:
        need = self._runs.pop(first_row)
        first = first_row // layout.UNWIND_CHUNK_ROWS
        self._clear(first, need)
        self._give(first, need)

    def set_process(self, tgid: int, mappings: Sequence[layout.UnwindMapping]) -> None:
        """The process's tabled mappings (sorted by start, at most the limit)."""
        record = layout.UnwindProc(nr=len(mappings))
        for i, m in enumerate(mappings[:layout.MAX_UNWIND_MAPPINGS]):
            record.maps[i] = m
        record.nr = min(len(mappings), layout.MAX_UNWIND_MAPPINGS)
        self._procs[ctypes.c_uint32(tgid)] = record

    def remove_process(self, tgid: int) -> None:
        with contextlib.suppress(KeyError):
            del self._procs[ctypes.c_uint32(tgid)]

    def _install_chunk(self, slot: int, part: bytes) -> None:
        try:
            fd = create_chunk_map()
        except PermissionError:
            if self._maker is None:
                raise
            fd = self._maker()  # CAP_BPF is gone: the chunk maker keeps it
        try:
            n = len(part) // ROW_BYTES
            if n:
                values = ctypes.create_string_buffer(part, len(part))
                count = ctypes.c_uint32(n)
                err = self._lib.bpf_map_update_batch(fd, self._keys, values,
                                                     ctypes.byref(count), None)
                if err < 0:
                    raise OSError(-err, f"writing unwind rows: {os.strerror(-err)}")
            key = ctypes.c_uint32(slot)
            value = ctypes.c_uint32(fd)
            err = self._lib.bpf_map_update_elem(self._outer_fd, ctypes.byref(key),
                                                ctypes.byref(value), 0)
            if err < 0:
                raise OSError(-err, f"placing an unwind chunk: {os.strerror(-err)}")
        finally:
            os.close(fd)  # the outer map holds the chunk now

    def _clear(self, first: int, count: int) -> None:
        for slot in range(first, first + count):
            key = ctypes.c_uint32(slot)
            self._lib.bpf_map_delete_elem(self._outer_fd, ctypes.byref(key))

    def _take(self, need: int) -> int:
        for i, (start, count) in enumerate(self._free):
            if count >= need:
                if count == need:
                    del self._free[i]
                else:
                    self._free[i] = (start + need, count - need)
                return start
        raise TablesFull(f"no run of {need} free unwind chunk slots")

    def _give(self, first: int, count: int) -> None:
        runs = sorted([*self._free, (first, count)])
        merged: list[tuple[int, int]] = []
        for start, n in runs:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self._free = merged
