"""CPython 3.14+: PEP 768's remote-execution protocol, spoken from outside.

The target publishes its own layout: ``_Py_DebugOffsets`` sits at the start
of its ``.PyRuntime`` section and gives the offset of every field used here
(interpreter list, thread list, each thread's ``_PyRemoteDebuggerSupport``
and ``eval_breaker``). Only the order of that struct's fields is version
specific (``LAYOUTS``, word indices, checked against the values read: the
script-path buffer must be 512 bytes, the version must match).

Steps (CPython's ``Doc/howto/remote_debugging.rst``): find the main
interpreter, refuse if its ``config.remote_debug`` is 0
(``PYTHON_DISABLE_REMOTE_DEBUG``, ``-X disable-remote-debug``), write the
script's path and ``debugger_pending_call = 1`` into a thread state, and
set ``_PY_EVAL_PLEASE_STOP_BIT`` in its ``eval_breaker``: the thread runs
the script at its next safe point, with the GIL.

Unlike ``sys.remote_exec``, every thread of the main interpreter is asked
(the script is idempotent): whichever reaches a safe point first runs it,
so a main thread blocked in C does not hold activation back. Thread states
are freed when threads exit, and ``eval_breaker`` is updated by the target's
own threads and signal handlers, so requests are written only while every
thread is stopped (a few hundred microseconds, reported as the stop time),
and the requests left over once the script ran are withdrawn the same way.

A request taken is not a script run: CPython clears the request before it
calls the audit hooks, opens the script and pushes its frame, and any of
these fails a frame or two short of the recursion limit or out of memory
(the target prints an unraisable error; nothing reaches the injector).
So while no answer comes, the threads are asked again every
``REASK_EVERY`` seconds (the injector's loop).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

from tramprof.inject import ptrace
from tramprof.inject.target import (
    REMOTE_DEBUG_DISABLED,
    UNSUPPORTED_VERSION,
    Refused,
    Target,
    pause_point,
)
from tramprof.procfs.memory import read_memory, write_memory

COOKIE = b"xdebugpy"
PLEASE_STOP_BIT = 1 << 5
SCRIPT_PATH_SIZE = 512
MAX_INTERPRETERS = 256
MAX_THREADS = 16384


@dataclass(frozen=True)
class Layout:
    """Word indices of the fields used, in ``_Py_DebugOffsets`` of one minor
    version (fields are appended to its sub-structs between versions)."""

    words: int                    # size of the struct, in 8-byte words
    native_thread_id: int
    debugger_support: int         # first of its six fields
    interpreters_head: int = 5
    interp_id: int = 7
    interp_next: int = 8
    threads_head: int = 9
    threads_main: int = 10
    thread_next: int = 24


LAYOUTS = {(3, 14): Layout(words=95, native_thread_id=28, debugger_support=89),
           (3, 15): Layout(words=111, native_thread_id=31, debugger_support=105)}


@dataclass(frozen=True)
class Offsets:
    interpreters_head: int
    interp_id: int
    interp_next: int
    threads_head: int
    threads_main: int
    thread_next: int
    eval_breaker: int
    remote_support: int           # _PyRemoteDebuggerSupport in PyThreadState
    remote_debug_enabled: int     # config.remote_debug in PyInterpreterState
    pending_call: int             # within _PyRemoteDebuggerSupport
    script_path: int              # within _PyRemoteDebuggerSupport


def read_offsets(target: Target, proc_root: str = "/proc") -> Offsets:
    layout = LAYOUTS.get(target.version)
    runtime = target.interpreter.py_runtime
    if layout is None or runtime is None:
        raise Refused(UNSUPPORTED_VERSION, f"no remote-execution layout for CPython "
                      f"{target.version_text}")
    raw = read_memory(target.pid, runtime, layout.words * 8, proc_root)
    if raw[:8] != COOKIE:
        raise Refused(UNSUPPORTED_VERSION, "no _Py_DebugOffsets cookie at .PyRuntime")
    words = struct.unpack(f"<{layout.words}Q", raw)
    version = words[1]
    if ((version >> 24) & 0xFF, (version >> 16) & 0xFF) != target.version:
        raise Refused(UNSUPPORTED_VERSION, f"debug offsets say version {version:#x}")
    d = layout.debugger_support
    if words[d + 5] != SCRIPT_PATH_SIZE:
        raise Refused(UNSUPPORTED_VERSION, "unexpected _Py_DebugOffsets layout "
                      f"(script path size {words[d + 5]})")
    return Offsets(interpreters_head=words[layout.interpreters_head],
                   interp_id=words[layout.interp_id], interp_next=words[layout.interp_next],
                   threads_head=words[layout.threads_head],
                   threads_main=words[layout.threads_main],
                   thread_next=words[layout.thread_next], eval_breaker=words[d],
                   remote_support=words[d + 1], remote_debug_enabled=words[d + 2],
                   pending_call=words[d + 3], script_path=words[d + 4])


def _word(pid: int, address: int, proc_root: str) -> int:
    return int(struct.unpack("<Q", read_memory(pid, address, 8, proc_root))[0])


@dataclass(frozen=True)
class Withdrawal:
    """What withdrawing the requests found: a thread whose request is gone
    took it (or exited), so "all still waiting" means no thread reached a
    safe point, and "some taken" with no report means the script was stopped
    inside the target (an audit or open-code hook, an unraisable error)."""

    stop_seconds: float
    asked: int      # threads asked that still exist
    waiting: int    # of those, still holding the request

    @property
    def none_taken(self) -> bool:
        return self.waiting == self.asked


def _encoded(script_path: str) -> bytes:
    encoded = script_path.encode()
    if len(encoded) >= SCRIPT_PATH_SIZE or b"\0" in encoded:
        raise ValueError(f"script path too long for the target: {script_path!r}")
    return encoded


class RemoteExec:
    def __init__(self, target: Target, proc_root: str = "/proc") -> None:
        self.target = target
        self.proc_root = proc_root
        self.offsets = read_offsets(target, proc_root)
        self.interp = self._main_interpreter()
        #: Thread states asked so far (a freed one's address may be reused
        #: by a new thread, which then counts as asked: a rare overcount).
        self.asked: set[int] = set()
        enabled = struct.unpack("<i", read_memory(
            target.pid, self.interp + self.offsets.remote_debug_enabled, 4, proc_root))[0]
        if enabled != 1:
            raise Refused(REMOTE_DEBUG_DISABLED, "remote debugging is disabled in the "
                          "interpreter (PYTHON_DISABLE_REMOTE_DEBUG, -X disable-remote-debug "
                          "or a build without it)")

    def _main_interpreter(self) -> int:
        pid, o = self.target.pid, self.offsets
        assert self.target.interpreter.py_runtime is not None
        interp = _word(pid, self.target.interpreter.py_runtime + o.interpreters_head,
                       self.proc_root)
        for _ in range(MAX_INTERPRETERS):
            if interp == 0:
                break
            if _word(pid, interp + o.interp_id, self.proc_root) == 0:
                return interp
            interp = _word(pid, interp + o.interp_next, self.proc_root)
        raise Refused(UNSUPPORTED_VERSION, "the main interpreter was not found")

    def thread_states(self) -> list[int]:
        pid, o = self.target.pid, self.offsets
        out: list[int] = []
        tstate = _word(pid, self.interp + o.threads_head, self.proc_root)
        while tstate and len(out) < MAX_THREADS:
            out.append(tstate)
            tstate = _word(pid, tstate + o.thread_next, self.proc_root)
        return out

    def main_thread_state(self) -> int:
        return _word(self.target.pid, self.interp + self.offsets.threads_main, self.proc_root)

    def _ask(self, tstate: int, encoded: bytes) -> None:
        """Write one thread's request (every thread stopped: see schedule)."""
        o, pid = self.offsets, self.target.pid
        support = tstate + o.remote_support
        write_memory(pid, support + o.script_path, encoded + b"\0")
        write_memory(pid, support + o.pending_call, struct.pack("<i", 1))
        breaker = tstate + o.eval_breaker
        value = _word(pid, breaker, self.proc_root)
        write_memory(pid, breaker, struct.pack("<Q", value | PLEASE_STOP_BIT))

    def withdraw_main(self) -> bool:
        """Clear the main thread's request if it was not taken; whether it
        was still waiting."""
        tstate = self.main_thread_state()
        if tstate and self._pending(tstate) == 1:
            write_memory(self.target.pid, tstate + self.offsets.remote_support
                         + self.offsets.pending_call, struct.pack("<i", 0))
            return True
        return False

    def _pending(self, tstate: int) -> int:
        address = tstate + self.offsets.remote_support + self.offsets.pending_call
        return int(struct.unpack("<i", read_memory(self.target.pid, address, 4,
                                                   self.proc_root))[0])

    def schedule(self, script_path: str, deadline: float,
                 main_only: bool = False) -> tuple[int, float]:
        """Ask every thread (or the main thread only) to run ``script_path``;
        (threads asked again after they took an earlier request and the
        script did not answer, seconds the process was stopped).

        The main thread is preferred: the script's own frames then pass on
        its stack, not on a worker's, where scan mode could take their stale
        return addresses for frames. Asking again is safe: the script claims
        the activation once, later runs return at once. Every thread is
        stopped even to ask one: a thread state may be freed meanwhile, and
        ``eval_breaker`` is also set by the other threads and by signal
        handlers, so a read-modify-write while they run could drop their bit
        (a signal's Python handler would then wait for the next signal)."""
        encoded = _encoded(script_path)
        pid = self.target.pid
        main = self.main_thread_state() if main_only else 0
        if main_only and main == 0:
            raise Refused(UNSUPPORTED_VERSION, "the main thread state is not available")
        again = 0
        began = time.monotonic()
        with ptrace.stopped(pid, deadline):
            states = [main] if main_only else self.thread_states()
            for tstate in states:
                again += tstate in self.asked and self._pending(tstate) != 1
                self._ask(tstate, encoded)   # the stop bit again too: a handler
                # that returned early (a signal's exception) may have cleared it
            self.asked.update(states)
            pause_point("scheduled")
        return again, time.monotonic() - began

    def withdraw(self, deadline: float) -> Withdrawal:
        """Clear the requests no thread has taken yet."""
        o, pid = self.offsets, self.target.pid
        began = time.monotonic()
        waiting = 0
        with ptrace.stopped(pid, deadline):
            asked = 0
            for tstate in self.thread_states():
                asked += tstate in self.asked
                if self._pending(tstate) == 1:
                    waiting += 1
                    write_memory(pid, tstate + o.remote_support + o.pending_call,
                                 struct.pack("<i", 0))
        return Withdrawal(time.monotonic() - began, asked, waiting)
