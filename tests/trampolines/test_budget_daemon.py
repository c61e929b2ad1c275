"""The runtime under the daemon as shipped: ``tramprof run`` (its privileges
dropped to nobody with CAP_SYS_PTRACE, as the service and the DaemonSet run
it) sets the duty cycle of a runtime in a process of another user (root
here), and at its default interval unwinds and budgets a short-lived worker
from its first moments, not from the next drain. The duty-cycle test drives
the pipeline in process, as root, with drains every 0.25 s, so it cannot see
what the dropped privileges forbid nor what a 10 s interval delays."""

from __future__ import annotations

import os
import time

import pytest
from tramprof.model import PYTHON_PAUSED

from tests.e2e.test_daemon import Daemon
from tests.hostile.test_attacks import folded

from .conftest import Interp

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64",
                       reason="the runtime generates x86-64 code only"),
]

#: Recursive calls only: the hook's cost is a third of the time or more, so a
#: budget of 0.05 keeps it on for about a seventh of the time.
CALLS = """
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
print("ready", flush=True)
while True:
    fib(20)
"""
BUDGET = 0.05
#: Samples of the last window that must carry the paused marker: ~85% at the
#: duty cycle this budget gives (0.13 measured on 3.13), none if it is never set.
MIN_PAUSED_SHARE = 0.5
#: Seconds the daemon gets to measure the cost and set the duty cycle (it
#: drains every 0.25 s; the runtime measures its cost about once a second).
SETTLE_SECONDS = 20.0
WINDOW_SECONDS = 3


def budgeted_daemon(*args: str) -> Daemon:
    """``tramprof run`` with ``python_overhead_budget = BUDGET`` (from its
    environment, as a unit's Environment= would set it)."""
    os.environ["TRAMPROF_PYTHON_OVERHEAD_BUDGET"] = str(BUDGET)
    try:
        return Daemon(*args)
    finally:
        del os.environ["TRAMPROF_PYTHON_OVERHEAD_BUDGET"]


def paused_share(d: Daemon, pid: int) -> tuple[float, int]:
    stacks = folded(d, pid, WINDOW_SECONDS)
    total = sum(stacks.values())
    paused = sum(count for stack, count in stacks.items() if PYTHON_PAUSED in stack)
    return (paused / total if total else 0.0), total


def test_the_daemon_sets_the_duty_cycle_of_another_users_process(
        host_interp: Interp, started) -> None:
    daemon = budgeted_daemon("--interval", "0.25", "--frequency", "199")
    try:
        proc = host_interp.popen("-c", CALLS, env={"TRAMPROF_TRAMPOLINES": "1"})
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        share, total = 0.0, 0
        deadline = time.monotonic() + SETTLE_SECONDS
        while time.monotonic() < deadline:
            time.sleep(WINDOW_SECONDS)
            share, total = paused_share(daemon, proc.pid)
            if share >= MIN_PAUSED_SHARE and total >= 100:
                break
        refused = [line for line in daemon.log if "cannot set its duty cycle" in line]
        assert not refused, refused[:3]
        assert total >= 100, (total, daemon.log_tail())
        assert share >= MIN_PAUSED_SHARE, (share, total, daemon.log_tail())
        # What a fleet sees of it: no refused write, and the one runtime
        # process's exported duty cycle well below always on.
        metrics = daemon.metrics()
        assert metrics[("tramprof_python_duty_writes_failed_total", ())] == 0
        duty = [v for (name, _), v in metrics.items() if name == "tramprof_python_duty_cycle"]
        assert len(duty) == 1 and duty[0] <= 0.5, duty
    finally:
        assert daemon.stop() == 0, "the daemon did not stop cleanly"


#: A worker that lives a few seconds, shorter than the default interval.
WORKER = """
import time
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
end = time.monotonic() + %(seconds)s
while time.monotonic() < end:
    fib(20)
"""
WORKER_SECONDS = 4.0
#: Samples of the worker's life that must name its Python frames or say they
#: are paused: the first ~0.1 s (until its runtime is found) and its start-up
#: and exit show neither. Before, a worker was found at the first drain of
#: its life (10 s apart by default), if there was one.
MIN_PYTHON_SHARE = 0.9


def test_a_short_lived_worker_is_unwound_and_budgeted_from_its_start(
        host_interp: Interp, started) -> None:
    daemon = budgeted_daemon("--frequency", "199")  # the default interval: 10 s
    try:
        proc = host_interp.popen("-c", WORKER % {"seconds": WORKER_SECONDS},
                                 env={"TRAMPROF_TRAMPOLINES": "1"})
        started.append(proc)
        assert proc.wait(timeout=60) == 0, proc.stderr.read() if proc.stderr else ""
        # Its samples are named at the next drain, at most an interval away.
        stacks: dict[tuple[str, ...], int] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stacks = folded(daemon, proc.pid, 60)
            if sum(stacks.values()) >= 0.5 * WORKER_SECONDS * 199:
                break
            time.sleep(1)
        total = sum(stacks.values())
        assert total >= 0.5 * WORKER_SECONDS * 199, (total, daemon.log_tail())
        paused = sum(c for stack, c in stacks.items() if PYTHON_PAUSED in stack)
        named = sum(c for stack, c in stacks.items() if PYTHON_PAUSED not in stack
                    and stack[1:3] == ("py::<module>:<string>", "py::fib:<string>"))
        top = sorted(stacks.items(), key=lambda kv: -kv[1])[:8]
        assert (paused + named) / total >= MIN_PYTHON_SHARE, (paused, named, total, top)
        # At the duty cycle this budget gives (~0.13), most of its life paused.
        assert paused / total >= MIN_PAUSED_SHARE, (paused, named, total, top)
    finally:
        assert daemon.stop() == 0, "the daemon did not stop cleanly"
