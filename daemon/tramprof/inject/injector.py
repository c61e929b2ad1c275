"""Inject one process: inspect it, place its files, ask it, wait for its answer.

``inject(pid)`` never raises for anything the target does or is: the
outcome is a ``Result`` whose ``result`` is a metric label value
(``ok``, a refusal reason from ``target``, ``timeout``, ``failed``,
``not_active`` for ``--off``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tramprof.inject import hijack, pep768, ptrace
from tramprof.inject.files import PlacementError, make_private_dir
from tramprof.inject.script import Outcome, activation_code
from tramprof.inject.target import (
    GONE,
    PEP768_FROM,
    PERF_TRAMPOLINE_FROM,
    PTRACE_DENIED,
    UNSUPPORTED_VERSION,
    Refused,
    Target,
    inspect,
)
from tramprof.procfs.memory import MemoryReadError

log = logging.getLogger(__name__)

OK = "ok"
TIMEOUT = "timeout"
FAILED = "failed"
NOT_ACTIVE = "not_active"
#: Every value of the ``result`` label, in a stable order.
RESULTS = (OK, "already_active", "not_cpython", "unsupported_version",
           "remote_debug_disabled", "ptrace_denied", "self", GONE, TIMEOUT, FAILED, NOT_ACTIVE)
#: The runtime library the target loads, as the chain mode expects its path.
RUNTIME_NAME = "tramprof_trampolines/_runtime.so"
#: Longest runtime library accepted from the runtime directory.
MAX_RUNTIME_BYTES = 16 << 20
#: After withdrawing the leftover requests, how long a thread that took one
#: just before may need to open the script (it holds the GIL until then).
_WITHDRAW_GRACE = 0.1
#: 3.14+: how long the main thread alone is given before every thread is asked.
MAIN_THREAD_GRACE = 0.5
#: 3.14+: then, how often every thread is asked again while no answer came
#: (a request taken can fail before the script starts; see pep768).
REASK_EVERY = 1.0
#: 3.9-3.13: the pause before the pending call is queued again while no
#: answer came; each further pause is twice the last (queued at 0, 1, 3, 7,
#: 15 s...). The first call to start claims the activation, later ones return
#: at once; each costs a stop of well under a millisecond and 8 KiB of code.
PENDING_REASK_AFTER = 1.0
#: Activation failures that tell where the activation happened to run, not
#: what the target is: deep in a recursion, near its limit (a test of the
#: recursion limit, a recursive parser), or short of memory for a moment.
#: Asked again a little later, it runs somewhere else.
TRANSIENT_FAILURES = ("RecursionError", "MemoryError")
#: The pauses (seconds) before each new attempt after such a failure.
RETRY_PAUSES = (0.2, 0.5, 1.0, 2.0)


@dataclass(frozen=True)
class Result:
    pid: int
    result: str
    detail: str = ""
    method: str = ""          # pep768 | ptrace
    mode: str = ""            # chain | perf
    version: str = ""
    stop_seconds: float = 0.0  # how long threads of the target were stopped
    seconds: float = 0.0       # from the start until the target answered

    @property
    def ok(self) -> bool:
        return self.result == OK

    def render(self) -> str:
        what = f"pid {self.pid}"
        if self.version:
            what += f" (CPython {self.version})"
        if self.ok:
            return (f"{what}: {self.detail or 'ok'} via {self.method}; stopped "
                    f"{self.stop_seconds * 1e3:.2f} ms, answered in {self.seconds:.2f} s")
        return f"{what}: {self.result}: {self.detail}"


class RuntimeStore:
    """Prebuilt runtime libraries for the versions without perf trampolines,
    one file per minor version: ``_runtime-cp39.so``, ``_runtime-cp311.so``."""

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self.directory = Path(directory) if directory else default_runtime_dir()

    def path_for(self, version: tuple[int, int]) -> Path:
        return self.directory / f"_runtime-cp{version[0]}{version[1]}.so"

    def load(self, version: tuple[int, int]) -> bytes | None:
        path = self.path_for(version)
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_RUNTIME_BYTES + 1)
        except OSError:
            return None
        return data if len(data) <= MAX_RUNTIME_BYTES else None


def default_runtime_dir() -> Path:
    return Path(__file__).resolve().parent / "runtimes"


def _wait_outcome(read: Callable[[], bytes], deadline: float) -> Outcome | None:
    pause = 0.002
    while True:
        outcome = Outcome.parse(read())
        if outcome is not None:
            return outcome
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 1.5, 0.05)


def inject(pid: int, *, off: bool = False, timeout: float = 5.0,
           runtimes: RuntimeStore | None = None, proc_root: str = "/proc") -> Result:
    """Turn trampolines on (or off) in ``pid``; waits up to ``timeout`` seconds
    for the target to run the activation and say how it went (per attempt: a
    transient failure is asked again after each of ``RETRY_PAUSES``)."""
    result = _inject_once(pid, off, timeout, runtimes, proc_root)
    for pause in RETRY_PAUSES:
        if result.result != FAILED or not result.detail.startswith(TRANSIENT_FAILURES):
            break
        log.info("pid %d: %s; asking again in %g s", pid, result.detail, pause)
        time.sleep(pause)
        result = _inject_once(pid, off, timeout, runtimes, proc_root)
    return result


def _timeout_detail(timeout: float, method: str, none_taken: bool | None,
                    asked: int) -> str:
    """Why no answer came, as far as the request's state tells."""
    detail = f"the interpreter did not run the activation within {timeout:g} s"
    if method == "ptrace":
        return (detail + f" (queued {asked} time{'s' if asked != 1 else ''}: it runs at the "
                "next point where the main thread executes Python code; if it ran a few "
                "frames short of the recursion limit, it failed before it could answer and "
                "the target's stderr shows a RecursionError)")
    if none_taken is None:
        return (detail + " (it runs at the next point where the main thread executes "
                "Python code)")
    if none_taken:
        return (detail + ": no thread took the request (each stayed in C code or waited "
                "for the GIL the whole time)")
    return (detail + ": a thread took the request but the script reported nothing (an "
            "audit hook or open-code hook refused it, or it failed before its first line; "
            "the target's stderr says which)")


def _inject_once(pid: int, off: bool, timeout: float, runtimes: RuntimeStore | None,
                 proc_root: str) -> Result:
    began = time.monotonic()
    try:
        target = inspect(pid, proc_root, for_off=off)
    except Refused as refused:
        return Result(pid, refused.reason, refused.detail)
    version = target.version_text
    runtime = None
    if not off and target.version < PERF_TRAMPOLINE_FROM:
        runtime = (runtimes or RuntimeStore(None)).load(target.version)
        if runtime is None:
            return Result(pid, UNSUPPORTED_VERSION, "no prebuilt runtime for CPython "
                          f"{target.version[0]}.{target.version[1]} in "
                          f"{(runtimes or RuntimeStore(None)).directory} (a source checkout builds "
                          "them with `make runtimes`)", version=version)
    try:
        placed = make_private_dir(pid, target.euid, target.egid, proc_root)
    except PlacementError as exc:
        return Result(pid, FAILED, f"cannot place files in its root: {exc.strerror or exc}",
                      version=version)
    method = "pep768" if target.version >= PEP768_FROM else "ptrace"
    stop = 0.0
    none_taken: bool | None = None   # pep768: whether any asked thread took the request
    asked = 0                        # ptrace: pending calls queued
    try:
        result_path = placed.write("result", b"", target.euid, target.egid)
        runtime_path = (placed.write(RUNTIME_NAME, runtime, target.euid, target.egid)
                        if runtime is not None else None)
        code = activation_code(result_path, runtime_path, off)
        deadline = began + timeout
        if method == "pep768":
            remote = pep768.RemoteExec(target, proc_root)
            script = placed.write("activate.py", code.encode(), target.euid, target.egid)
            # The main thread first; every thread if it does not answer soon
            # (it may be blocked in C), and again while no answer comes.
            _again, stop = remote.schedule(script, time.monotonic() + 0.5, main_only=True)
            asked_all = taken = False
            try:
                outcome = _wait_outcome(lambda: placed.read("result"),
                                        min(deadline, time.monotonic() + MAIN_THREAD_GRACE))
                while outcome is None and time.monotonic() < deadline:
                    asked_all = True
                    again, stopped = remote.schedule(script, time.monotonic() + 0.5)
                    stop += stopped
                    if again:
                        taken = True
                        log.info("pid %d: %d thread(s) took the request but the script did not "
                                 "answer (see the target's stderr); asked again", pid, again)
                    outcome = _wait_outcome(lambda: placed.read("result"),
                                            min(deadline, time.monotonic() + REASK_EVERY))
            finally:
                with contextlib.suppress(OSError, ptrace.StepTimeout, MemoryReadError):
                    if asked_all:
                        withdrawal = remote.withdraw(time.monotonic() + 0.5)
                        stop += withdrawal.stop_seconds
                        none_taken = withdrawal.none_taken and not taken
                    else:
                        none_taken = remote.withdraw_main()
                    time.sleep(_WITHDRAW_GRACE)
        else:
            # Queued again while no answer comes, after pauses that double: a
            # call that ran where its statement cannot even compile (at or a
            # few frames short of the recursion limit) left nothing to report.
            pause = PENDING_REASK_AFTER
            while True:
                scheduled = hijack.schedule_pending_call(target, code)
                stop += scheduled.stop_seconds
                asked += 1
                if scheduled.result != 0 and asked == 1:
                    return Result(pid, FAILED, f"Py_AddPendingCall returned {scheduled.result} "
                                  "(its queue is full)", method, version=version,
                                  stop_seconds=stop)
                if asked > 1:
                    log.info("pid %d: no answer to the pending call; queued it again", pid)
                queue_full = scheduled.result != 0      # then wait for what is queued
                wait_until = deadline if queue_full else min(deadline, time.monotonic() + pause)
                outcome = _wait_outcome(lambda: placed.read("result"), wait_until)
                if outcome is not None or time.monotonic() >= deadline:
                    break
                pause *= 2
    except Refused as refused:
        return Result(pid, refused.reason, refused.detail, method, version=version,
                      stop_seconds=stop)
    except ptrace.TraceeGone as exc:
        return Result(pid, GONE, str(exc), method, version=version, stop_seconds=stop)
    except ptrace.StepTimeout as exc:
        return Result(pid, TIMEOUT, f"a ptrace step timed out: {exc}", method,
                      version=version, stop_seconds=stop)
    except (OSError, hijack.HijackError, ValueError) as exc:
        code_ = getattr(exc, "errno", None)
        reason = PTRACE_DENIED if code_ in (errno.EPERM, errno.EACCES) else FAILED
        if code_ == errno.ESRCH:
            reason = GONE
        return Result(pid, reason, str(exc), method, version=version, stop_seconds=stop)
    finally:
        placed.remove()
    elapsed = time.monotonic() - began
    if outcome is None:
        return Result(pid, TIMEOUT, _timeout_detail(timeout, method, none_taken, asked), method,
                      version=version, stop_seconds=stop, seconds=elapsed)
    if outcome.status == "ok":
        detail = f"{outcome.mode} trampolines {'off' if off else 'on'}"
        return Result(pid, OK, detail, method, outcome.mode, version, stop, elapsed)
    reason = {"already_active": "already_active", "not_active": NOT_ACTIVE}.get(
        outcome.status, FAILED)
    return Result(pid, reason, outcome.detail or outcome.status, method, outcome.mode,
                  version, stop, elapsed)


__all__ = ["RESULTS", "Result", "RuntimeStore", "Target", "inject"]
