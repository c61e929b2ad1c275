"""An activation that runs where it cannot succeed - deep in a recursion, a
frame or two below the limit - fails with RecursionError; the injector asks
again a moment later, and the target, back near its root, is activated."""

from __future__ import annotations

import logging
import os

import pytest
from tramprof.inject.injector import Result, inject

from .conftest import finish, make_python

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, chroots"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only"),
]

# Spins HEADROOM frames short of the recursion limit for a second, then
# computes near the root until told to stop; prints what it computed. With
# 5 frames left, 3.11 fails to start the activation's own function (the
# statement's handler reports it); with 8, the activation fails inside.
# (With 3 or 4, even compiling the statement fails: the target prints the
# error and nothing is reported; the call is queued again until one runs it
# near the root. 3.13 reports a RecursionError with 1 to 3 frames left and
# cannot start only at the limit itself. 3.14 with 1 to 3 left takes the
# request and fails before anything can report: the threads are asked again
# in the same way.)
TARGET = r"""
import select, sys, time

def probe(n):
    try:
        return probe(n + 1)
    except RecursionError:
        return n

DEEPEST = probe(0)

def deep(n):
    if n == DEEPEST - HEADROOM0:
        print("deep", flush=True)
    if n < DEEPEST - HEADROOM:
        return deep(n + 1)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        pass
    return n

deep(0)
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0.01)[0]:
    sum(i for i in range(100))
print(sum(i * i for i in range(1000)))
"""


def _activate_deep(name: str, headroom: int, caplog: pytest.LogCaptureFixture) -> Result:
    """Inject into TARGET while it spins ``headroom`` frames short of the
    recursion limit: it must be activated and then finish as usual."""
    python = make_python(name)
    script = python.host_path(f"{python.workdir}/deep.py")
    script.write_text(TARGET.replace("HEADROOM", str(headroom)))
    proc, pid = python.start(f"{python.workdir}/deep.py")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "deep"
        with caplog.at_level(logging.INFO, logger="tramprof.inject.injector"):
            result = inject(pid, timeout=10.0)
        assert result.ok, result.render()
        assert proc.stdout.readline().strip() == "ready"
    finally:
        output = finish(proc) if proc.poll() is None else ""
    assert output.strip() == str(sum(i * i for i in range(1000)))
    return result


# The two ways in: a ptrace-scheduled pending call (our runtime, 3.11) and
# PEP 768 (CPython's trampolines, 3.14).
@pytest.mark.parametrize("headroom", [5, 8])
@pytest.mark.parametrize("name", ["host-3.11", "sid-3.14"])
def test_an_activation_that_hit_the_recursion_limit_is_asked_again(
        name: str, headroom: int, runtime_dir, caplog: pytest.LogCaptureFixture) -> None:
    _activate_deep(name, headroom, caplog)
    retried = [r.getMessage() for r in caplog.records if "asking again" in r.getMessage()]
    assert retried and "RecursionError" in retried[0], caplog.text


# The ptrace pending call, into our runtime (3.11) and into CPython's
# trampolines (3.13). CPython's own test_exceptions recurses to the limit:
# a single call landing there would leave an injection into regrtest waiting
# for an answer while the target ran on.
@pytest.mark.parametrize(("name", "headroom"), [("host-3.11", 3), ("trixie-3.13", 0)])
def test_a_pending_call_that_cannot_start_is_queued_again(
        name: str, headroom: int, runtime_dir, caplog: pytest.LogCaptureFixture) -> None:
    """Three frames short of the limit even the statement cannot be compiled.
    The pending call must still succeed (a failed pending call would make the
    target's own code fail: a SystemError where it spins), and the call
    queued again once nothing answers activates the target near its root."""
    python = make_python(name)
    script = python.host_path(f"{python.workdir}/deep.py")
    script.write_text(TARGET.replace("HEADROOM", str(headroom)))
    proc, pid = python.start(f"{python.workdir}/deep.py")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "deep"
        with caplog.at_level(logging.INFO, logger="tramprof.inject.injector"):
            result = inject(pid, timeout=10.0)
    finally:
        out, err = proc.communicate("stop\n", timeout=60)
    assert result.ok, result.render()
    assert result.seconds > 1.0, result.render()   # answered back near the root
    queued_again = [r for r in caplog.records if "queued it again" in r.getMessage()]
    assert queued_again, caplog.text
    assert proc.returncode == 0, err[-3000:]
    assert "RecursionError" in err, err[-3000:]     # the first call did fail
    assert "SystemError" not in err, err[-3000:]
    assert out.split() == ["ready", str(sum(i * i for i in range(1000)))], out


@pytest.mark.parametrize("headroom", [1, 3])
def test_a_request_taken_where_nothing_can_report_is_asked_again(
        headroom: int, runtime_dir, caplog: pytest.LogCaptureFixture) -> None:
    result = _activate_deep("sid-3.14", headroom, caplog)
    asked_again = [r.getMessage() for r in caplog.records
                   if "took the request but the script did not answer" in r.getMessage()]
    assert asked_again, caplog.text
    assert result.seconds > 1.0, result.render()   # answered back near the root
