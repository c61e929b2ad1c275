"""The one reader (``/proc/PID/mem``) and writer of another process's memory.

What a process keeps in its memory is the attacker's to choose: a runtime
descriptor can claim any address or size. Every read therefore goes through
here, bounded by ``MAX_READ_BYTES`` and checked for a full result, and fails
with one exception type that callers count per process.

Needs the right to read the target's memory: the same uid with ptrace access,
or CAP_SYS_PTRACE.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import weakref
from typing import Any

# The largest single read: a CPython trampoline arena is 64 KiB, a vdso 8 KiB,
# a descriptor 136 bytes and its arena table 16 bytes per arena.
MAX_READ_BYTES = 1 << 20


class MemoryReadError(OSError):
    """The memory could not be read or written in full (unmapped, no
    permission, gone, or a size beyond the bounds); ``errno`` says why when
    the kernel did (ESRCH or ENOENT: the process is gone)."""


def _check_address(address: int) -> None:
    if not 0 <= address < 1 << 64:
        raise MemoryReadError(f"address {address:#x} is outside the address space")


def _open_mem(pid: int, address: int, flags: int, proc_root: str) -> tuple[int, str]:
    """(fd, path) of ``/proc/PID/mem`` after the address check."""
    _check_address(address)
    path = f"{proc_root}/{pid}/mem"
    try:
        return os.open(path, flags | os.O_CLOEXEC), path
    except OSError as exc:
        raise MemoryReadError(exc.errno, f"cannot open {path}: {exc.strerror}") from exc


def _check_read(pid: int, size: int) -> None:
    if not 0 <= size <= MAX_READ_BYTES:
        raise MemoryReadError(f"refusing to read {size} bytes of process {pid}'s memory "
                              f"(at most {MAX_READ_BYTES})")


def _pread(fd: int, path: str, address: int, size: int) -> bytes:
    try:
        data = os.pread(fd, size, address)
    except (OSError, OverflowError) as exc:
        raise MemoryReadError(f"cannot read {path} at {address:#x}: "
                              f"{getattr(exc, 'strerror', None) or exc}") from exc
    if len(data) != size:
        raise MemoryReadError(f"short read of {path} at {address:#x}: {len(data)} of "
                              f"{size} bytes")
    return data


def read_memory(pid: int, address: int, size: int, proc_root: str = "/proc") -> bytes:
    """Exactly ``size`` bytes at ``address`` of process ``pid``."""
    _check_read(pid, size)
    fd, path = _open_mem(pid, address, os.O_RDONLY, proc_root)
    try:
        return _pread(fd, path, address, size)
    finally:
        os.close(fd)


def _close_all(fds: dict[int, tuple[int, str]]) -> None:
    for fd, _path in fds.values():
        os.close(fd)
    fds.clear()


def descriptor_share() -> int:
    """An eighth of the descriptors this process may open, at most 1024: the
    share of each kind of file the daemon holds open between uses (memory
    files here, perf maps in symbols.tailreader), so they never starve it of
    descriptors (a systemd service gets 1024 by default)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1024
    return max(1, min(1024, soft // 8))


class OpenMemory:
    """``read_memory`` for processes read again and again (a runtime's
    descriptor, every second): their ``/proc/PID/mem`` stays open between
    reads, for at most ``max_open`` processes at a time (default: see
    ``descriptor_share``); the others are read as ``read_memory`` does.

    An open file reads the address space it was opened on, never a later
    one: after the process exits or execs, or its pid is reused, it reads
    nothing. So a failed read through a file held from before is tried once
    more on a fresh one, and a read goes to whatever process has the pid
    now, as ``read_memory`` does.
    """

    def __init__(self, proc_root: str = "/proc", max_open: int | None = None) -> None:
        self.proc_root = proc_root
        self.max_open = descriptor_share() if max_open is None else max_open
        self._fds: dict[int, tuple[int, str]] = {}  # pid -> (fd, path), oldest first
        weakref.finalize(self, _close_all, self._fds)

    def __len__(self) -> int:
        return len(self._fds)

    def read(self, pid: int, address: int, size: int) -> bytes:
        """Exactly ``size`` bytes at ``address`` of process ``pid``."""
        _check_read(pid, size)
        held = self._fds.get(pid)
        if held is not None:
            try:
                return _pread(*held, address, size)
            except MemoryReadError:
                self.forget(pid)
        if len(self._fds) >= self.max_open:
            # Not one held file for another: a refresh reads every process in
            # turn, and swapping would leave none of them held.
            return read_memory(pid, address, size, self.proc_root)
        fd, path = _open_mem(pid, address, os.O_RDONLY, self.proc_root)
        try:
            data = _pread(fd, path, address, size)
        except MemoryReadError:
            os.close(fd)
            raise
        self._fds[pid] = (fd, path)
        return data

    def forget(self, pid: int) -> None:
        """Close the process's file, if one is open."""
        held = self._fds.pop(pid, None)
        if held is not None:
            os.close(held[0])


#: The largest single write: a 4-byte control word, or a PEP 768 script path
#: (CPython's buffer for it is 512 bytes).
MAX_WRITE_BYTES = 512


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@functools.cache
def _process_vm_writev() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    function = libc.process_vm_writev
    function.restype = ctypes.c_ssize_t
    function.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                         ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong]
    return function


def write_memory(pid: int, address: int, data: bytes, proc_root: str = "/proc") -> None:
    """Write ``data`` at ``address`` of process ``pid`` (a control word the
    process published for profilers to set, a request to the interpreter;
    raises ``MemoryReadError``).

    Under this namespace's ``/proc``, through ``process_vm_writev``: it needs
    ptrace attach rights only (the same uid, or CAP_SYS_PTRACE), whereas
    opening ``/proc/PID/mem`` for writing also needs write permission on a
    file of mode 0600 owned by the target's user, which the daemon (running
    as nobody, with CAP_DAC_READ_SEARCH but not CAP_DAC_OVERRIDE) lacks for
    every other user's process. Under another proc root, whose pids are not
    this namespace's, through its ``/proc/PID/mem``."""
    if not 0 < len(data) <= MAX_WRITE_BYTES:
        raise MemoryReadError(f"refusing to write {len(data)} bytes to process {pid}")
    if proc_root != "/proc":
        _write_through_mem(pid, address, data, proc_root)
        return
    _check_address(address)
    buffer = ctypes.create_string_buffer(data, len(data))
    local = _IoVec(ctypes.cast(buffer, ctypes.c_void_p), len(data))
    remote = _IoVec(ctypes.c_void_p(address), len(data))
    written = _process_vm_writev()(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if written < 0:
        code = ctypes.get_errno()
        raise MemoryReadError(code, f"cannot write {len(data)} bytes at {address:#x} of "
                                    f"process {pid}: {os.strerror(code)}")
    if written != len(data):
        raise MemoryReadError(f"short write to process {pid} at {address:#x}: {written} of "
                              f"{len(data)} bytes")


def _write_through_mem(pid: int, address: int, data: bytes, proc_root: str) -> None:
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
