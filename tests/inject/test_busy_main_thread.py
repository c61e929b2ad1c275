"""A main thread that runs Python without a system call, next to a helper
thread blocked in one: before 3.12 a pending call wakes the main thread only
when the main thread itself scheduled it (CPython computes the eval breaker
for the thread that calls Py_AddPendingCall), so the activation must be
scheduled from the main thread, interrupted wherever it is."""

from __future__ import annotations

import os

import pytest
from tramprof.inject.injector import OK, RuntimeStore, inject

from .conftest import make_python

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, chroots"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only"),
]

# The helper waits on a lock (blocked in futex) for the whole run; the main
# thread computes for SECONDS without ever releasing the GIL (no system call:
# the clock is read through the vDSO), which is what makes it recompute its
# eval breaker.
SECONDS = 8
TARGET = r"""
import sys, threading, time

blocked = threading.Lock()
blocked.acquire()
helper = threading.Thread(target=blocked.acquire, daemon=True)
helper.start()
print("ready", flush=True)

def work(n):
    return sum(i * i for i in range(n))

end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    work(1000)
print("done", flush=True)
"""


@pytest.mark.parametrize("name", ["bullseye-3.9", "host-3.11", "trixie-3.13"])
def test_activation_reaches_a_main_thread_that_never_blocks(name: str, runtime_dir) -> None:
    python = make_python(name)
    proc, pid = python.start("-c", TARGET, str(SECONDS))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        result = inject(pid, timeout=SECONDS / 2, runtimes=RuntimeStore(runtime_dir))
        assert result.result == OK, result.render()
        out, err = proc.communicate(timeout=SECONDS + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and out.strip() == "done", err[-3000:]
