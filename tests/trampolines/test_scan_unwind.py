"""Complete Python stacks for CPython 3.13 ``-X perf`` (stubs we do not
control) on a Python without frame pointers: the profiler scans the stack for
the stubs' return addresses ("scan" mode; root, Debian trixie's python3.13)."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler
from tramprof.sampler.layout import Counter as BpfCounter
from tramprof.unwind.scan import ScanMode, ScanProcess

from .conftest import Interp, root_interp
from .test_chain_unwind import assert_exact_chain, python_frames, record, share, start, stop

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
    pytest.mark.roots,
]


@pytest.fixture(scope="module")
def trixie() -> Interp:
    return root_interp("trixie")


def start_perf(interp: Interp, *args: str) -> subprocess.Popen[str]:
    # CPython's own trampolines; our runtime stays inactive (no TRAMPROF_TRAMPOLINES).
    return start(interp, *args, env={}, options=("-X", "perf"))


def test_exact_python_chain(trixie: Interp) -> None:
    assert_exact_chain(start_perf(trixie, "chain", "30"), 0.90)


def test_recursion_60_deep_is_exact_to_the_root(trixie: Interp) -> None:
    proc = start_perf(trixie, "recurse", "30", "60")
    try:
        stacks = record(proc.pid)
    finally:
        stop(proc)
    # Every frame is there (the window reaches the root) and no other: a stale
    # stub return address left in a live C frame (here one from start-up,
    # between main and the recursion) is not taken for a frame.
    expected = ["<module>", "main", *["descend"] * 60, "leaf"]
    reached = share(stacks, lambda s: python_frames(s) == expected)
    assert reached >= 0.90, [(len(python_frames(s)), c) for s, c in stacks.items()][:5]


PAGE = 4096


def start_fixed(interp: Interp, pad: int) -> subprocess.Popen[str]:
    """recurse 60 under ``-X perf`` with address randomization off: the
    stack's layout then depends only on argv and the environment, here
    ``pad`` bytes longer."""
    proc = interp.popen("-X", "perf", interp.script("nesting.py"), "recurse", "30", "60",
                        env={"PAD": "x" * pad}, wrapper=("setarch", os.uname().machine, "-R"))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def stale_words(pid: int, installed: ScanProcess) -> list[int]:
    """Addresses of the stub return addresses on the stopped process's live
    stack (above its innermost running stub frame) whose caller's word is
    not in the interpreter's text: what the scan must not take for frames."""
    caller = installed.caller
    assert caller is not None and caller.checks_text, installed
    stride, roff = installed.layout.stride, installed.layout.return_offset
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    [line] = [ln for ln in maps if ln.endswith("[stack]")]
    low, high = (int(x, 16) for x in line.split()[0].split("-"))
    os.kill(pid, signal.SIGSTOP)
    try:
        with open(f"/proc/{pid}/mem", "rb") as mem:
            mem.seek(low)
            data = mem.read(high - low)
    finally:
        os.kill(pid, signal.SIGCONT)
    words = struct.unpack(f"<{len(data) // 8}Q", data)
    up = caller.offset // 8
    live, stale = [], []
    for i, word in enumerate(words[:-up]):
        if word % stride == roff % stride and \
                any(a <= word < b for a, b in installed.arenas.ranges):
            running = caller.start <= words[i + up] < caller.end
            (live if running else stale).append(low + 8 * i)
    return [address for address in stale if address > min(live)]


def test_a_stale_word_with_its_callers_word_on_the_next_page_is_not_a_frame(
        trixie: Interp) -> None:
    """The caller check reads the word ``caller.offset`` bytes above a
    candidate; past the page the scan has copied, that word is read on its
    own. Placed there by padding the environment (randomization off), the
    start-up stale word is rejected as it is elsewhere."""
    expected = ["<module>", "main", *["descend"] * 60, "leaf"]
    window = Config().scan_window_bytes
    proc = start_fixed(trixie, 0)
    try:
        profiled = _profile(proc.pid, window, 3)
        [where] = stale_words(proc.pid, profiled.installed)
    finally:
        stop(proc)
    assert share(profiled.stacks, lambda s: python_frames(s) == expected) >= 0.90
    caller = profiled.installed.caller
    assert caller is not None and caller.offset >= 16, profiled.installed
    # The last slot of a page at the word's 16-byte alignment (the kernel
    # keeps the stack 16-byte aligned below the environment's strings).
    target = PAGE - 8 if (PAGE - 8 - where % PAGE) % 16 == 0 else PAGE - 16
    pad = (where % PAGE - target) % PAGE
    proc = start_fixed(trixie, pad)
    try:
        profiled = _profile(proc.pid, window, 3)
        moved = stale_words(proc.pid, profiled.installed)
    finally:
        stop(proc)
    assert [address % PAGE for address in moved] == [target], (hex(where), pad, moved)
    exact = share(profiled.stacks, lambda s: python_frames(s) == expected)
    assert exact >= 0.90, [(len(python_frames(s)), c) for s, c in profiled.stacks.items()][:5]


def profile_recursion(interp: Interp, depth: int, scan_bytes: int, seconds: float = 3
                      ) -> tuple[dict[tuple[str, ...], int], dict[BpfCounter, int]]:
    """Stacks and BPF counters of a ``depth``-deep recursion under ``-X perf``,
    from an in-process profiler with its own scan window (the daemon's
    pipeline, as ``tramprof run`` builds it)."""
    proc = start_perf(interp, "recurse", "30", str(depth))
    try:
        profiled = _profile(proc.pid, scan_bytes, seconds)
    finally:
        stop(proc)
    return profiled.stacks, profiled.counters


@dataclass
class Profiled:
    stacks: dict[tuple[str, ...], int]
    counters: dict[BpfCounter, int]
    installed: ScanProcess  # what the scan mode installed for the process


def _profile(pid: int, scan_bytes: int, seconds: float) -> Profiled:
    """Stacks of ``pid`` from an in-process profiler, its BPF counters and
    the process's stub layout, arenas and caller check."""
    profiler = Profiler(Config(pids=(pid,), frequency=499, scan_window_bytes=scan_bytes))
    stacks: Counter[tuple[str, ...]] = Counter()
    profiler.start()
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            profiler.wait(0.2)
            for s in profiler.collect():
                if s.pid == pid:
                    stacks[(s.comm, *s.frames)] += s.count
        [scan] = [m for m in profiler.unwinders.modes if isinstance(m, ScanMode)]
        return Profiled(dict(stacks), profiler.bpf_counters(), scan._procs[pid])
    finally:
        profiler.close()


def test_a_short_window_keeps_the_innermost_frames_and_says_so(trixie: Interp) -> None:
    # 60 frames take ~28 KiB of native stack on 3.13; a 16 KiB window (two runs
    # of the scan program) holds the innermost ~35 of them.
    stacks, counters = profile_recursion(trixie, 60, scan_bytes=16384)
    cut = share(stacks, lambda s: 20 <= python_frames(s).count("descend") < 60
                and python_frames(s)[-1] == "leaf" and "main" not in python_frames(s))
    assert cut >= 0.90, [(python_frames(s)[:3], c) for s, c in stacks.items()][:5]
    recorded = sum(stacks.values())
    assert counters[BpfCounter.SCAN_TRUNCATED] >= 0.90 * recorded, (counters, recorded)


def test_a_long_window_runs_the_scan_program_several_times(trixie: Interp) -> None:
    # 100 frames (~46 KiB) need six runs of 8 KiB: the tail calls carry the
    # scan on to the root. The start-up stale word is rejected, and counted.
    stacks, counters = profile_recursion(trixie, 100, scan_bytes=65536)
    expected = ["<module>", "main", *["descend"] * 100, "leaf"]
    exact = share(stacks, lambda s: python_frames(s) == expected)
    assert exact >= 0.90, [(len(python_frames(s)), c) for s, c in stacks.items()][:5]
    assert counters[BpfCounter.SCAN_TRUNCATED] == 0
    # CPython's start-up leaves one stub return address in the C frames
    # between main and the recursion (seen by reading the stopped process's
    # stack): every sample meets it, and counts it.
    assert counters[BpfCounter.SCAN_STALE] >= 0.90 * sum(stacks.values()), counters
    assert counters[BpfCounter.SCAN_SAMPLES] >= 0.90 * sum(stacks.values())
