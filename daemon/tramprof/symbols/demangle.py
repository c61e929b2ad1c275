"""Readable names for mangled C++ (Itanium) and Rust symbols.

Rust names (v0 ``_R...`` and legacy ``_ZN...17h<hash>E``) go to
``rustc-demangle`` (the Rust project's own demangler, through ``pyderust``):
it has recursion and output-size limits of its own, and drops the legacy
hash as perf does.

C++ names go to libstdc++'s ``__cxa_demangle``, the demangler of c++filt and
perf (so names read exactly as theirs), but never in this process: a few
hundred bytes of nested back-references make it print gigabytes (a 265-byte
name: 2.2 GB and 19 s), and a symbol name is the profiled binary's to
choose. It runs in a worker process that limits its own address space; a
name that takes longer than ``timeout`` seconds is abandoned with the worker
(which is started again for the next name), and results over
``MAX_DEMANGLED_CHARS`` are dropped. Such a name stays mangled and is
counted. (Under the systemd unit, whose seccomp filter denies setrlimit, the
service's own memory limit stands in for the worker's.) Names are demangled
when a frame first needs them, and remembered.
"""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import pyderust

#: Longer names are left as they are (libstdc++ refuses those over about
#: 1 KiB anyway: its component limit).
MAX_MANGLED_CHARS: Final = 4096
MAX_DEMANGLED_CHARS: Final = 16384
#: The worker's address-space limit: a Python with libstdc++ needs ~30 MiB.
WORKER_MEMORY_BYTES: Final = 256 << 20

# Failure reasons (counter labels).
TOO_LONG: Final = "demangle_too_long"
TIMEOUT: Final = "demangle_timeout"
UNAVAILABLE: Final = "demangle_unavailable"

# What mangled names are made of; anything else is not sent to the worker
# (the protocol is one name a line).
_MANGLED_CHARS = re.compile(r"[A-Za-z0-9_.$]+")
_RUST_LEGACY = re.compile(r"17h[0-9a-f]{16}E(?:\.|$)")

_WORKER_SOURCE: Final = r"""
import ctypes, resource, sys
limit = int(sys.argv[1])
try:
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
except OSError:  # a seccomp filter without setrlimit: the timeout still bounds it
    pass
cap = int(sys.argv[2])
cxx = ctypes.CDLL("libstdc++.so.6")
libc = ctypes.CDLL("libc.so.6")
demangle = getattr(cxx, "__cxa_demangle")
demangle.restype = ctypes.c_void_p
demangle.argtypes = (ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.POINTER(ctypes.c_int))
libc.free.argtypes = (ctypes.c_void_p,)
libc.strnlen.restype = ctypes.c_size_t
libc.strnlen.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
out = sys.stdout.buffer
out.write(b"ready\n")
out.flush()
for line in sys.stdin.buffer:
    status = ctypes.c_int(-4)
    p = demangle(line.rstrip(b"\n"), None, None, ctypes.byref(status))
    reply = b"-"
    if p:
        n = libc.strnlen(p, cap + 1)
        if status.value == 0 and n > cap:
            reply = b"!"
        elif status.value == 0:
            text = ctypes.string_at(p, n)
            if text and b"\n" not in text:
                reply = b"+" + text
        libc.free(p)
    out.write(reply + b"\n")
    out.flush()
"""


class _WorkerFailed(Exception):
    """The worker timed out, died or could not be started (``reason``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _CxxWorker:
    """A child process running ``__cxa_demangle``, one name a line."""

    def __init__(self, timeout: float, max_chars: int) -> None:
        self.timeout = timeout
        self.max_chars = max_chars
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self.starts = 0

    def demangle(self, name: str) -> str | None:
        """The demangled name, None if it is not a valid C++ name; raises
        ``_WorkerFailed`` (with TOO_LONG the worker stays, otherwise it is gone)."""
        if self._proc is None:
            self._start()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(name.encode("ascii") + b"\n")
            self._proc.stdin.flush()
        except OSError:
            self.stop()
            raise _WorkerFailed(UNAVAILABLE) from None
        line = self._read_line()
        if line == b"!":
            raise _WorkerFailed(TOO_LONG)
        return line[1:].decode("ascii", "replace") if line.startswith(b"+") else None

    def _start(self) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WORKER_SOURCE,
                 str(WORKER_MEMORY_BYTES), str(self.max_chars)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                bufsize=0)
        except OSError:
            raise _WorkerFailed(UNAVAILABLE) from None
        self._proc, self._buffer = proc, b""
        self.starts += 1
        if self._read_line() != b"ready":
            self.stop()
            raise _WorkerFailed(UNAVAILABLE)

    def _read_line(self) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        # poll, not select: a daemon watching hundreds of processes holds
        # over a thousand descriptors, and select() refuses those past 1023
        # (the worker, started late, gets one).
        readable = select.poll()
        readable.register(fd, select.POLLIN)
        deadline = time.monotonic() + self.timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not readable.poll(left * 1000):
                self.stop()
                raise _WorkerFailed(TIMEOUT)
            chunk = os.read(fd, 65536)
            if not chunk or len(self._buffer) + len(chunk) > self.max_chars + 2:
                self.stop()
                raise _WorkerFailed(UNAVAILABLE)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


#: How Itanium C++ (and legacy Rust) and Rust v0 mangled names begin.
MANGLED_PREFIXES = ("_Z", "_R")


class Demangler:
    """Demangles symbol names; shared by all symbolizers, thread-safe.

    ``on_failure`` is called with a reason for every name left mangled
    because it was too long or the worker failed on it (not for names that
    simply are not mangled). After ``max_restarts`` worker failures within
    ``restart_window`` seconds, C++ names are left mangled until the window
    has passed.
    """

    def __init__(self, *, timeout: float = 1.0, on_failure: Callable[[str], None] | None = None,
                 max_cache_chars: int = 8 << 20, max_restarts: int = 5,
                 restart_window: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._worker = _CxxWorker(timeout, MAX_DEMANGLED_CHARS)
        self._on_failure = on_failure
        self._max_cache_chars = max_cache_chars
        self._max_restarts = max_restarts
        self._restart_window = restart_window
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, str] = {}
        self._cache_chars = 0
        self._failures: deque[float] = deque()

    @property
    def worker_starts(self) -> int:
        return self._worker.starts

    def demangle(self, name: str) -> str:
        """``name`` demangled, or ``name`` itself when it is not mangled or
        cannot be demangled."""
        if not name.startswith(MANGLED_PREFIXES):
            return name
        with self._lock:
            cached = self._cache.get(name)
            if cached is not None:
                return cached
            result = self._demangle(name)
            if result is None:  # worker unavailable for now: try again later
                return name
            if self._cache_chars + len(name) + len(result) > self._max_cache_chars:
                self._cache.clear()
                self._cache_chars = 0
            self._cache[name] = result
            self._cache_chars += len(name) + len(result)
            return result

    def _demangle(self, name: str) -> str | None:
        if len(name) > MAX_MANGLED_CHARS or not _MANGLED_CHARS.fullmatch(name):
            if len(name) > MAX_MANGLED_CHARS:
                self._fail(TOO_LONG)
            return name
        if name.startswith("_R") or _RUST_LEGACY.search(name):
            rust = _demangle_rust(name)
            if rust is not None or name.startswith("_R"):
                return rust or name
        if not name.startswith("_Z"):
            return name
        now = self._clock()
        while self._failures and now - self._failures[0] >= self._restart_window:
            self._failures.popleft()
        if len(self._failures) >= self._max_restarts:
            return None
        try:
            demangled = self._worker.demangle(name)
        except _WorkerFailed as e:
            self._fail(e.reason)
            if e.reason == TOO_LONG:
                return name
            self._failures.append(now)
            return name if e.reason == TIMEOUT else None
        return demangled if demangled is not None else name

    def _fail(self, reason: str) -> None:
        if self._on_failure is not None:
            self._on_failure(reason)

    def close(self) -> None:
        """Stop the worker (it also exits by itself when this process does)."""
        with self._lock:
            self._worker.stop()


def _demangle_rust(name: str) -> str | None:
    try:
        text = pyderust.demangle(name)
    except (pyderust.DemangleError, ValueError):
        return None
    return text if len(text) <= MAX_DEMANGLED_CHARS else None
