"""ctypes mirrors of the records in ``bpf/tramprof.h``.

The BPF side writes these; the daemon reads them with exactly these layouts.
This is the contract between the two sides; nothing else defines a record.
``tests/unit/test_bpf_layout.py`` compiles the header and checks every size,
offset and constant against this module.
"""

from __future__ import annotations

import ctypes
import enum

MAX_FRAMES = 127
MAX_TRAMP = 256
COMM_LEN = 16

USTACK_TRUNCATED = 0x1
USTACK_FAULT = 0x2
USTACK_NO_USER = 0x4
CHAIN_TRUNCATED = 0x8
CHAIN_INVALID = 0x10
SCAN_TRUNCATED = 0x20
SCAN_OVERFLOW = 0x40
TABLE_STOP = 0x80
USTACK_ROOT = 0x100
PYTHON_PAUSED = 0x200
# The stored-stack hash bit of stacks with trampoline frames (``ustacks``;
# clear: ``native_ustacks``).
USTACK_HASH_TRAMP = 0x2

CFA_KIND_BITS = 3
CFA_KIND_MASK = 7
CFA_RSP = 0
CFA_RBP = 1
CFA_PLT = 2
CFA_SIGNAL = 3
CFA_END = 4
CFA_NONE = 5
CFA_UNSUPPORTED = 6
UNWIND_CHUNK_ROWS = 4096
MAX_UNWIND_MAPPINGS = 64


class Counter(enum.IntEnum):
    """Per-CPU counters kept by the BPF program (``enum tp_counter``)."""

    SAMPLES = 0
    RECORDED = 1
    IDLE = 2
    FILTERED = 3
    LOST_COUNTS_FULL = 4
    LOST_USTACKS_FULL = 5
    LOST_USTACK_COLLISION = 6
    KSTACK_COLLISION = 7
    KSTACK_ERROR = 8
    USTACK_FAULT = 9
    USTACK_TRUNCATED = 10
    KERNEL_THREAD = 11
    CHAIN_SAMPLES = 12
    CHAIN_TRUNCATED = 13
    CHAIN_INVALID = 14
    SCAN_SAMPLES = 15
    SCAN_TRUNCATED = 16
    SCAN_STALE = 17
    SCAN_OVERFLOW = 18
    TABLE_SAMPLES = 19
    TABLE_STOP_NONE = 20
    TABLE_STOP_UNSUPPORTED = 21


COUNTER_COUNT = len(Counter)


class Config(ctypes.Structure):
    # stamp: 0 in every write; the BPF programs set it (tp_config.stamp).
    _fields_ = [("active_buffer", ctypes.c_uint32), ("filter_pids", ctypes.c_uint32),
                ("stamp", ctypes.c_uint64)]


class Frame(ctypes.Structure):
    _fields_ = [("ip", ctypes.c_uint64), ("sp", ctypes.c_uint64)]


class UserStack(ctypes.Structure):
    _fields_ = [
        ("nr", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("check", ctypes.c_uint64),
        ("nr_tramp", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("frames", Frame * MAX_FRAMES),
        ("tramp", Frame * MAX_TRAMP),
    ]


class NativeStack(ctypes.Structure):
    """A stored stack without trampoline frames (value of ``native_ustacks``):
    ``UserStack`` up to ``tramp``."""

    _fields_ = UserStack._fields_[:-1]


class ChainProc(ctypes.Structure):
    """A process running the trampoline runtime (value of ``chain_procs``)."""

    _fields_ = [("tls_offset", ctypes.c_int64), ("stub_stride", ctypes.c_uint32),
                ("record_self", ctypes.c_uint32), ("paused_addr", ctypes.c_uint64)]


class ScanProc(ctypes.Structure):
    """A process unwound by stack scan (value of ``scan_procs``)."""

    _fields_ = [("arena_min", ctypes.c_uint64), ("arena_span", ctypes.c_uint64),
                ("stride_mask", ctypes.c_uint32), ("return_offset", ctypes.c_uint32),
                ("caller_min", ctypes.c_uint64), ("caller_span", ctypes.c_uint64),
                ("caller_offset", ctypes.c_uint32), ("word_phase", ctypes.c_uint32)]


class StubPage(ctypes.Structure):
    """Key of ``stub_pages``: one page of a process's trampoline arena."""

    _fields_ = [("tgid", ctypes.c_uint32), ("pad", ctypes.c_uint32), ("page", ctypes.c_uint64)]


class UnwindRow(ctypes.Structure):
    """One row of an unwind table (``tp_unwind_row``)."""

    _fields_ = [("pc", ctypes.c_uint32), ("cfa", ctypes.c_uint16), ("rbp", ctypes.c_int16)]


class UnwindMapping(ctypes.Structure):
    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("bias", ctypes.c_uint64),
                ("first_row", ctypes.c_uint32), ("nr_rows", ctypes.c_uint32)]


class UnwindProc(ctypes.Structure):
    """A process unwound with tables (value of ``unwind_procs``)."""

    _fields_ = [("nr", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("maps", UnwindMapping * MAX_UNWIND_MAPPINGS)]


class SampleKey(ctypes.Structure):
    _fields_ = [
        ("tgid", ctypes.c_uint32),
        ("kstack_id", ctypes.c_int32),
        ("start_boottime", ctypes.c_uint64),
        ("exec_id", ctypes.c_uint64),
        ("ustack_hash", ctypes.c_uint64),
        ("comm", ctypes.c_char * COMM_LEN),
    ]


class CountKey(ctypes.Structure):
    """Key of the ``counts`` map (defined in profile.bpf.c)."""

    _fields_ = [("sample", SampleKey), ("buffer", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


class UserStackKey(ctypes.Structure):
    """Key of the ``ustacks`` and ``native_ustacks`` maps (defined in profile.bpf.c)."""

    _fields_ = [("hash", ctypes.c_uint64), ("buffer", ctypes.c_uint32), ("pad", ctypes.c_uint32)]


class ProcessSeen(ctypes.Structure):
    """Event sent the first time a process image is sampled."""

    _fields_ = [("tgid", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("start_boottime", ctypes.c_uint64), ("exec_id", ctypes.c_uint64)]
