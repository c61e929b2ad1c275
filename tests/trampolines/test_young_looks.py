"""Young Python interpreters (pipeline.young), in a real profiler (root;
Debian's system python3): one that never loads trampolines costs one maps
read, however its address space moves; one that activates the runtime a
moment after start is taken before the first drain."""

from __future__ import annotations

import os
import subprocess
import time
from collections import Counter

import pytest
from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler
from tramprof.symbols.usersyms import ProcessSymbolizer
from tramprof.unwind.mode import FP

from .conftest import Interp

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
]

#: Once told to go: busy, mapping 4 MiB more every 0.1 s (its vsize moves
#: between any two looks); activates the runtime after ``sys.argv[1]``
#: seconds if given.
GROWER = """
import sys, time
print("ready", flush=True)
sys.stdin.readline()
began, blocks, activate_at = time.monotonic(), [], float(sys.argv[1]) if sys.argv[1:] else None
while time.monotonic() - began < 4:
    if activate_at is not None and time.monotonic() - began >= activate_at:
        import tramprof_trampolines
        tramprof_trampolines.activate()
        activate_at = None
    blocks.append(bytearray(4 << 20))
    stop = time.monotonic() + 0.1
    while time.monotonic() < stop:
        sum(range(100))
"""


def _grower(interp: Interp, *args: str) -> subprocess.Popen[str]:
    proc = interp.popen("-c", GROWER, *args)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _run(profiler: Profiler, seconds: float, proc: subprocess.Popen[str]) -> float | None:
    """Let ``proc`` go, wait as the daemon does for ``seconds`` without a
    drain; when a trampoline mode took it (seconds after go), if one did."""
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    pid = proc.pid
    began = time.monotonic()
    taken = None
    while (left := began + seconds - time.monotonic()) > 0:
        profiler.wait(min(left, 1.0))
        if taken is None and profiler.unwinders.mode_of(pid) != FP:
            taken = time.monotonic() - began
    return taken


@pytest.fixture
def maps_reads(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Maps reads by pid."""
    reads: Counter[int] = Counter()
    real = ProcessSymbolizer.reload_maps

    def counted(self: ProcessSymbolizer) -> None:
        reads[self.pid] += 1
        real(self)

    monkeypatch.setattr(ProcessSymbolizer, "reload_maps", counted)
    return reads


def test_an_interpreter_without_trampolines_has_its_maps_read_once(
        host_interp: Interp, maps_reads: Counter[int]) -> None:
    proc = _grower(host_interp)
    profiler = Profiler(Config(pids=(proc.pid,), frequency=499, interval=10.0))
    try:
        profiler.start()
        # Past its last look (2 s after the first sample); before the change
        # to the looks, each of them read its maps again (its size moved).
        assert _run(profiler, 3.0, proc) is None
        assert maps_reads[proc.pid] == 1, maps_reads
    finally:
        profiler.close()
        proc.kill()
        proc.wait()


def test_an_interpreter_that_activates_the_runtime_is_taken_at_a_look(
        host_interp: Interp, maps_reads: Counter[int]) -> None:
    proc = _grower(host_interp, "0.3")
    profiler = Profiler(Config(pids=(proc.pid,), frequency=499, interval=10.0))
    try:
        profiler.start()
        taken = _run(profiler, 3.0, proc)
        # Activated 0.3 s after start: the look 0.5 s after the first sample
        # finds it (the one at 2 s at the latest), long before a drain.
        assert taken is not None and taken < 2.5, (taken, maps_reads)
        assert maps_reads[proc.pid] == 2, maps_reads  # the first sample, the look
    finally:
        profiler.close()
        proc.kill()
        proc.wait()
