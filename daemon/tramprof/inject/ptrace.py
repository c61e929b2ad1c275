"""ptrace(2) through ctypes, with a deadline on every wait.

Only what injection needs: seize and interrupt a thread (no signal is
sent, so nothing the target can observe besides a restarted system call),
read and write its registers and words, step it, and let it go. Every wait
polls ``waitpid(WNOHANG)`` against a deadline, so no step can hang the
caller; callers detach on every path (``Tracee`` is a context manager). A
tracer that dies is detached by the kernel, and its tracees resume.

All calls for one tracee must come from the thread that seized it.
"""

from __future__ import annotations

import ctypes
import errno
import gc
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

PTRACE_PEEKDATA = 2
PTRACE_POKEDATA = 5
PTRACE_CONT = 7
PTRACE_SINGLESTEP = 9
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_DETACH = 17
PTRACE_SYSCALL = 24
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_O_TRACESYSGOOD = 1
PTRACE_EVENT_STOP = 128
WALL = 0x40000000
SYSCALL_TRAP = signal.SIGTRAP | 0x80


class PtraceError(OSError):
    """A ptrace request failed (errno set)."""


class StepTimeout(TimeoutError):
    """A ptrace step did not finish before its deadline."""


class TraceeGone(ProcessLookupError):
    """The thread exited (or the process died) while traced."""


class Regs(ctypes.Structure):
    """struct user_regs_struct (x86-64)."""

    _fields_ = [(name, ctypes.c_ulonglong) for name in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx",
        "rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base",
        "gs_base", "ds", "es", "fs", "gs")]

    def copy(self) -> Regs:
        out = Regs()
        ctypes.memmove(ctypes.byref(out), ctypes.byref(self), ctypes.sizeof(Regs))
        return out

    @staticmethod
    def signed(value: int) -> int:
        return value - (1 << 64) if value >= 1 << 63 else value


_libc: ctypes.CDLL | None = None


def libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        # Not ctypes.util.find_library: it runs ldconfig, tens of milliseconds.
        lib = ctypes.CDLL("libc.so.6", use_errno=True)
        lib.ptrace.restype = ctypes.c_long
        lib.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        _libc = lib
    return _libc


def ptrace(request: int, tid: int, addr: int = 0, data: int | ctypes.c_void_p = 0) -> int:
    ctypes.set_errno(0)
    result = libc().ptrace(request, tid, ctypes.c_void_p(addr),
                           data if isinstance(data, ctypes.c_void_p) else ctypes.c_void_p(data))
    err = ctypes.get_errno()
    if result == -1 and err:
        raise PtraceError(err, f"ptrace({request:#x}, {tid}): {os.strerror(err)}")
    return int(result)


def wait_stop(tid: int, deadline: float) -> int:
    """The next wait status of ``tid`` (a stop, or its end), before ``deadline``."""
    # Poll without sleeping for the first 2 ms: a stop or a step takes
    # microseconds, and a sleeping tracer can wait long for the CPU on a busy
    # machine while the target stays stopped.
    spin_until = time.monotonic() + 0.002
    pause = 20e-6
    while True:
        try:
            got, status = os.waitpid(tid, os.WNOHANG | WALL)
        except ChildProcessError as exc:
            raise TraceeGone(errno.ECHILD, f"thread {tid} is no longer traced") from exc
        if got:
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                raise TraceeGone(errno.ESRCH, f"thread {tid} exited")
            return status
        now = time.monotonic()
        if now >= deadline:
            raise StepTimeout(f"thread {tid} did not stop in time")
        if now < spin_until:
            continue
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, 1e-3)


class Tracee:
    """One seized thread. ``signals`` collects signals that arrived while we
    held it; they are sent again after detaching, so none is lost."""

    def __init__(self, tid: int, tgid: int) -> None:
        self.tid = tid
        self.tgid = tgid
        self.attached = False
        self.stopped = False
        self.signals: list[int] = []

    def seize_and_stop(self, deadline: float) -> None:
        ptrace(PTRACE_SEIZE, self.tid, 0, PTRACE_O_TRACESYSGOOD)
        self.attached = True
        ptrace(PTRACE_INTERRUPT, self.tid)
        self.wait(deadline)

    def wait(self, deadline: float) -> int:
        """Wait for the next stop; a signal-delivery stop is remembered (and
        the signal suppressed when the thread is resumed)."""
        status = wait_stop(self.tid, deadline)
        self.stopped = True
        sig = os.WSTOPSIG(status)
        if status >> 16 == 0 and sig not in (signal.SIGTRAP, SYSCALL_TRAP):
            self.signals.append(sig)
        return status

    def getregs(self) -> Regs:
        regs = Regs()
        ptrace(PTRACE_GETREGS, self.tid, 0, ctypes.c_void_p(ctypes.addressof(regs)))
        return regs

    def setregs(self, regs: Regs) -> None:
        ptrace(PTRACE_SETREGS, self.tid, 0, ctypes.c_void_p(ctypes.addressof(regs)))

    def peek(self, address: int) -> int:
        ctypes.set_errno(0)
        value = libc().ptrace(PTRACE_PEEKDATA, self.tid, ctypes.c_void_p(address), None)
        err = ctypes.get_errno()
        if err:
            raise PtraceError(err, f"peek {address:#x}: {os.strerror(err)}")
        return int(value) & 0xFFFFFFFFFFFFFFFF

    def poke(self, address: int, word: int) -> None:
        ptrace(PTRACE_POKEDATA, self.tid, address,
               ctypes.c_void_p(word if word < 1 << 63 else word - (1 << 64)))

    def write(self, address: int, data: bytes) -> None:
        """Write through ptrace (works on read-only pages, as a debugger's
        breakpoints do); ``address`` and the length are padded to words."""
        if address % 8:
            raise ValueError("unaligned write")
        data = data + b"\0" * (-len(data) % 8)
        try:  # one write where /proc/PID/mem may be written (as root)
            fd = os.open(f"/proc/{self.tgid}/mem", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                if os.pwrite(fd, data, address) == len(data):
                    return
            except OSError:
                pass
            finally:
                os.close(fd)
        for i in range(0, len(data), 8):
            self.poke(address + i, int.from_bytes(data[i:i + 8], "little"))

    def resume(self, request: int = PTRACE_CONT) -> None:
        ptrace(request, self.tid, 0, 0)
        self.stopped = False

    def ensure_stopped(self, deadline: float) -> None:
        """Interrupt the thread if it runs, and wait for it to stop."""
        if not self.stopped:
            ptrace(PTRACE_INTERRUPT, self.tid)
            self.wait(deadline)

    def detach(self) -> None:
        """Let the thread go (it must be stopped), then re-send held signals."""
        if not self.attached:
            return
        try:
            ptrace(PTRACE_DETACH, self.tid, 0, 0)
        except PtraceError as exc:
            if exc.errno != errno.ESRCH:
                raise
        finally:
            self.attached = False
            self.stopped = False
        for sig in dict.fromkeys(self.signals):
            with suppress(OSError):
                _tgkill(self.tgid, self.tid, sig)

    def force_detach(self, deadline: float) -> None:
        """Stop the thread wherever it is and detach (the error path)."""
        if not self.attached:
            return
        with suppress(PtraceError, StepTimeout, TraceeGone):
            self.ensure_stopped(deadline)
        self.detach()


def _tgkill(tgid: int, tid: int, sig: int) -> None:
    ctypes.set_errno(0)
    if libc().syscall(ctypes.c_long(234), ctypes.c_long(tgid), ctypes.c_long(tid),
                      ctypes.c_long(sig)) != 0:  # SYS_tgkill on x86-64
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextmanager
def no_gc() -> Iterator[None]:
    """No cyclic garbage collection while a target is stopped: in a daemon
    holding many objects, one full collection takes tens of milliseconds."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextmanager
def stopped(pid: int, deadline: float) -> Iterator[list[Tracee]]:
    """Every thread of ``pid`` stopped (threads that exit meanwhile are
    skipped); all are detached when the block ends, whatever happens."""
    tracees: list[Tracee] = []
    collector = no_gc()
    collector.__enter__()
    try:
        for name in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            tracee = Tracee(int(name), pid)
            try:
                ptrace(PTRACE_SEIZE, tracee.tid, 0, PTRACE_O_TRACESYSGOOD)
            except PtraceError as exc:
                if exc.errno == errno.ESRCH:
                    continue
                raise
            tracee.attached = True
            tracees.append(tracee)
            ptrace(PTRACE_INTERRUPT, tracee.tid)
        for tracee in list(tracees):
            try:
                tracee.wait(deadline)
            except TraceeGone:
                tracee.attached = False
                tracees.remove(tracee)
        yield tracees
    finally:
        for tracee in tracees:
            try:
                tracee.detach()
            except PtraceError:
                tracee.force_detach(time.monotonic() + 0.05)
        collector.__exit__(None, None, None)
