"""The daemon's inject policy: a matching process is injected on its first
sample and then unwound with its Python frames; a process that does not
match is left alone."""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler

from .conftest import finish, make_python

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, BPF, chroots"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only"),
]


def test_matching_process_is_injected_and_other_is_not(runtime_dir) -> None:
    wanted = make_python("trixie-3.13")
    other = make_python("host-3.11")
    wanted_proc, wanted_pid = wanted.start_workload()
    other_proc, other_pid = other.start_workload()
    config = Config(pids=(wanted_pid, other_pid), frequency=499, interval=0.5,
                    inject_comm=("python3.13",), inject_runtime_dir=str(runtime_dir),
                    inject_interval=0.1)
    profiler = Profiler(config)
    profiler.start()
    named: Counter[int] = Counter()
    try:
        end = time.monotonic() + 6
        while time.monotonic() < end:
            profiler.wait(0.25)
            for stack in profiler.collect():
                if any(f.startswith("py::") for f in stack.frames):
                    named[stack.pid] += stack.count
        results = profiler.injector.snapshot()
        last = dict(profiler.injector.last)
    finally:
        profiler.close()
        finish(wanted_proc)
        finish(other_proc)
    assert results == Counter({"ok": 1}), (results, last)
    assert last[wanted_pid].mode == "perf"
    assert other_pid not in last
    assert named[wanted_pid] > 50, named
    assert named[other_pid] == 0, named

