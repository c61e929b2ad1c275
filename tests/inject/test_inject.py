"""tramprof inject on every interpreter: a workload started without any
profiling flag, in its own root and PID namespace, gets complete Python
stacks after injection, and computes exactly what it computes without."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from tramprof.config import Config
from tramprof.inject.injector import RuntimeStore, inject
from tramprof.pipeline.profiler import Profiler

from .conftest import Python, finish

THREADS = 3
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, BPF, chroots"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only"),
]


def python_frames(frames: tuple[str, ...]) -> list[str]:
    return [f[4:].split(":", 1)[0] for f in frames if f.startswith("py::")]


def collect(profiler: Profiler, pid: int, seconds: float) -> Counter[tuple[str, ...]]:
    stacks: Counter[tuple[str, ...]] = Counter()
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        profiler.wait(min(left, 0.25))
    for stack in profiler.collect():
        if stack.pid == pid:
            stacks[stack.frames] += stack.count
    return stacks


def profiler_state(profiler: Profiler, pid: int) -> dict[str, object]:
    """What the profiler knows of ``pid`` and its counters: shown when the
    stacks are not what they must be."""
    stats = profiler.stats
    return {"report": profiler.unwinders.report(pid), "unwound": stats.unwind_samples,
            "refusals": stats.unwind_refusals, "errors": stats.process_errors,
            "symbolization": stats.symbolization_failures, "jit": stats.jit_counters}


def expected_chain(thread: int) -> list[str]:
    return [f"outer_{thread}", "middle", "inner", "leaf"]


def test_injected_process_gets_complete_stacks(python: Python, runtime_dir) -> None:
    reference_proc, _ = python.start_workload(THREADS)
    reference = finish(reference_proc)

    proc, pid = python.start_workload(THREADS)
    profiler = Profiler(Config(pids=(pid,), frequency=499, interval=1.0))
    profiler.start()
    try:
        before = collect(profiler, pid, 1.5)
        assert sum(before.values()) > 50, before
        named = [s for s in before if python_frames(s)]
        assert named == [], named[:3]

        # The runtimes as shipped: the package's own directory, the default.
        assert runtime_dir == RuntimeStore(None).directory
        result = inject(pid)
        assert result.ok, result.render()
        expected_mode = "perf" if python.version >= (3, 12) else "chain"
        assert result.mode == expected_mode
        print(f"\n{python.name}: {result.render()}")
        profiler.injector.note_injected(pid)  # as the daemon does for its own injections
        collect(profiler, pid, 0.3)  # the drain that follows the injection
        after = collect(profiler, pid, 1.7)
        state = profiler_state(profiler, pid)
    finally:
        profiler.close()
        output = finish(proc)
    total = sum(after.values())
    assert total > 100, total  # the CPUs are shared: counts vary
    exact = {i: sum(c for s, c in after.items() if python_frames(s) == expected_chain(i))
             for i in range(THREADS)}
    share = sum(exact.values()) / total
    top = sorted(after.items(), key=lambda x: -x[1])[:4]
    # As text: a tuple would be shortened in the report, and the state is what
    # tells why (the unwinding mode, refusals, errors).
    assert share >= 0.95, f"{share:.3f} exact of {total}; top {top}; state {state}"
    assert all(count > 0.15 * total for count in exact.values()), exact  # every thread
    assert output == reference
