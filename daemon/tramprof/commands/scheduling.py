"""The main loop's scheduler slice: run at once when a process is sampled
for the first time.

A newly sampled process must be read while it runs (its maps, its mapped
files), and a short-lived one may have only milliseconds left. The loop
sleeps in poll() until the sampler's buffer wakes it, and the wake usually
comes from the CPU that process runs on. Linux's EEVDF scheduler (6.6 and
later) lets the running task finish its slice before a woken task with the
same request runs (``RUN_TO_PARITY``); the default slice is 0.7 ms x (1 +
log2 CPUs), 1.4 ms on two CPUs. The loop then finds the process it was
woken for already exited: of the busy-node benchmark's 5-ms processes
(started 20 times a second), 23-24% were gone before the loop read them,
13-15% with a 0.1-ms slice (side by side).

Since Linux 6.12 a thread may ask for its own slice (``sched_attr``'s
``sched_runtime`` for SCHED_OTHER and SCHED_BATCH, clamped to 0.1-100 ms),
and a woken task with a shorter slice than the running one preempts it
(``PREEMPT_SHORT``). That changes when the thread runs, not how much CPU it
gets: its weight (the nice value) stays. Only the calling thread is set, with
``SCHED_FLAG_RESET_ON_FORK``: the threads and children it starts later get
the kernel's defaults (that flag also resets a nice value below 0 to 0 in
them, as it does for any task). Earlier kernels take the request and ignore
it, and report no slice: the outcome says so, and nothing fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["LoopSlice", "SliceOutcome", "request_slice", "thread_slice"]

# sched_setattr / sched_getattr by machine (arch/*/syscall tables; the
# generic table serves arm64 and riscv64).
_SYSCALLS = {
    "x86_64": (314, 315),
    "aarch64": (274, 275),
    "riscv64": (274, 275),
    "ppc64le": (355, 356),
    "s390x": (345, 346),
}
# struct sched_attr, first version (SCHED_ATTR_SIZE_VER0): size, policy,
# flags, nice, priority, runtime, deadline, period.
_ATTR = struct.Struct("=IIQiIQQQ")
_SCHED_OTHER, _SCHED_BATCH = 0, 3
_FAIR_POLICIES = frozenset((_SCHED_OTHER, _SCHED_BATCH))
_RESET_ON_FORK = 0x01
_MIN_NS, _MAX_NS = 100_000, 100_000_000  # the kernel's clamp of a requested slice


@dataclass(frozen=True)
class SliceOutcome:
    """What a request left the thread with."""

    requested_ns: int  # 0: the kernel's default
    slice_ns: int  # as the kernel reports it after; 0: it reports none
    reason: str = ""  # why the request did not take effect; "" when it did

    @property
    def taken(self) -> bool:
        return not self.reason


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _syscall(number: int, *args: object) -> tuple[int, int]:
    result = _libc().syscall(number, *args)
    return int(result), ctypes.get_errno()


def _get(tid: int, numbers: tuple[int, int]) -> tuple[int, int, int, int] | OSError:
    """(policy, flags, nice, runtime ns) of thread ``tid`` (0: the caller)."""
    buf = ctypes.create_string_buffer(_ATTR.size)
    result, err = _syscall(numbers[1], ctypes.c_int(tid), buf, ctypes.c_uint(_ATTR.size),
                           ctypes.c_uint(0))
    if result != 0:
        return OSError(err, os.strerror(err))
    _size, policy, flags, nice, _priority, runtime, _deadline, _period = _ATTR.unpack(buf.raw)
    return policy, flags, nice, runtime


def thread_slice(tid: int = 0) -> int | None:
    """The slice the kernel reports for thread ``tid`` (0: the caller), in
    ns; 0 when it reports none (before 6.12); None when it cannot be asked."""
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    got = _get(tid, numbers)
    return None if isinstance(got, OSError) else got[3]


def request_slice(seconds: float) -> SliceOutcome:
    """Ask for a ``seconds`` slice for the calling thread (0: the kernel's
    default again), keeping its policy and nice value. Never raises: the
    outcome says what the thread has and, if the request did not take
    effect, why (logged by the caller)."""
    requested = round(seconds * 1e9)
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return SliceOutcome(requested, 0, f"sched_setattr's number on {platform.machine()} "
                                          "is not known")
    got = _get(0, numbers)
    if isinstance(got, OSError):
        return SliceOutcome(requested, 0, f"sched_getattr failed: {got.strerror}")
    policy, _flags, nice, before = got
    if policy not in _FAIR_POLICIES:
        return SliceOutcome(requested, before, f"the thread runs under scheduling policy "
                                               f"{policy}, set from outside: left as it is")
    attr = ctypes.create_string_buffer(_ATTR.pack(_ATTR.size, policy, _RESET_ON_FORK, nice, 0,
                                                  requested, 0, 0))
    result, err = _syscall(numbers[0], ctypes.c_int(0), attr, ctypes.c_uint(0))
    if result != 0:
        how = " (a system call filter?)" if err == errno.EPERM else ""
        return SliceOutcome(requested, before,
                            f"sched_setattr refused: {os.strerror(err)}{how}")
    after = _get(0, numbers)
    now = 0 if isinstance(after, OSError) else after[3]
    if now == 0:
        return SliceOutcome(requested, 0, "the kernel takes no slice requests (Linux 6.12 "
                                          "and later do)")
    if requested and now != min(max(requested, _MIN_NS), _MAX_NS):
        return SliceOutcome(requested, now, f"the kernel reports a {now} ns slice")
    return SliceOutcome(requested, now)


class LoopSlice:
    """The slice of a loop's thread: a short one while it waits for newly
    sampled processes, the kernel's default while it drains (~0.2 s of batch
    work on a busy node, which need not be preempted at every tick). Two
    requests a drain; none when the short one was not taken."""

    def __init__(self) -> None:
        self.outcome: SliceOutcome | None = None  # of the last request

    def set(self, seconds: float) -> SliceOutcome:
        """Ask for ``seconds`` from now on (0: the kernel's default)."""
        self.outcome = request_slice(seconds)
        return self.outcome

    @property
    def short(self) -> bool:
        """A short slice was asked for and taken."""
        return self.outcome is not None and self.outcome.requested_ns > 0 and self.outcome.taken

    def release(self) -> None:
        """The kernel's default slice again, if a short one was taken: the
        loop is over (its thread may go on, as in tests)."""
        if self.short:
            self.set(0)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """The kernel's default slice inside, the loop's own again after."""
        own = self.outcome if self.short else None
        if own is not None:
            request_slice(0)
        try:
            yield
        finally:
            if own is not None:
                request_slice(own.requested_ns / 1e9)
