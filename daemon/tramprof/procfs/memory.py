"""The one reader (and writer) of another process's memory (``/proc/PID/mem``).

What a process keeps in its memory is the attacker's to choose: a runtime
descriptor can claim any address or size. Every read therefore goes through
here, bounded by ``MAX_READ_BYTES`` and checked for a full result, and fails
with one exception type that callers count per process.

Needs the right to read the target's memory: the same uid with ptrace access,
or CAP_SYS_PTRACE.
"""

from __future__ import annotations

import os

# The largest single read: a CPython trampoline arena is 64 KiB, a vdso 8 KiB,
# a descriptor 136 bytes and its arena table 16 bytes per arena.
MAX_READ_BYTES = 1 << 20


class MemoryReadError(OSError):
    """The memory could not be read in full (unmapped, no permission, gone,
    or a size beyond ``MAX_READ_BYTES``)."""


def _open_mem(pid: int, address: int, flags: int, proc_root: str) -> tuple[int, str]:
    """(fd, path) of ``/proc/PID/mem`` after the address check."""
    if not 0 <= address < 1 << 64:
        raise MemoryReadError(f"address {address:#x} is outside the address space")
    path = f"{proc_root}/{pid}/mem"
    try:
        return os.open(path, flags | os.O_CLOEXEC), path
    except OSError as exc:
        raise MemoryReadError(f"cannot open {path}: {exc.strerror}") from exc


def read_memory(pid: int, address: int, size: int, proc_root: str = "/proc") -> bytes:
    """Exactly ``size`` bytes at ``address`` of process ``pid``."""
    if not 0 <= size <= MAX_READ_BYTES:
        raise MemoryReadError(f"refusing to read {size} bytes of process {pid}'s memory "
                              f"(at most {MAX_READ_BYTES})")
    fd, path = _open_mem(pid, address, os.O_RDONLY, proc_root)
    try:
        data = os.pread(fd, size, address)
    except (OSError, OverflowError) as exc:
        raise MemoryReadError(f"cannot read {path} at {address:#x}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from exc
    finally:
        os.close(fd)
    if len(data) != size:
        raise MemoryReadError(f"short read of {path} at {address:#x}: {len(data)} of "
                              f"{size} bytes")
    return data


#: The largest single write: the only one written is a 4-byte control word.
MAX_WRITE_BYTES = 64


def write_memory(pid: int, address: int, data: bytes, proc_root: str = "/proc") -> None:
    """Write ``data`` at ``address`` of process ``pid`` (a control word the
    process published for profilers to set; raises ``MemoryReadError``).
    Needs ptrace attach rights: the same uid, or CAP_SYS_PTRACE."""
    if not 0 < len(data) <= MAX_WRITE_BYTES:
        raise MemoryReadError(f"refusing to write {len(data)} bytes to process {pid}")
    fd, path = _open_mem(pid, address, os.O_WRONLY, proc_root)
    try:
        written = os.pwrite(fd, data, address)
    except (OSError, OverflowError) as exc:
        raise MemoryReadError(f"cannot write {path} at {address:#x}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from exc
    finally:
        os.close(fd)
    if written != len(data):
        raise MemoryReadError(f"short write to {path} at {address:#x}")
