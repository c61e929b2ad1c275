"""The daemon's inject policy: a matching process is injected on its first
sample and then unwound with its Python frames; a process that does not
match is left alone."""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from pathlib import Path

import pytest
from tramprof.config import Config
from tramprof.pipeline.profiler import Profiler

from .conftest import finish, make_python

#: The workload's Python chain as folded frames.
CHAIN = re.compile(r"py::outer_\d:<string>;py::middle:[^;]*/workload\.py;"
                   r"py::inner:[^;]*/workload\.py;py::leaf:[^;]*/workload\.py")

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


def test_the_daemon_injects_after_dropping_its_privileges(runtime_dir, tmp_path) -> None:
    """`tramprof run` itself, which runs as nobody with a few capabilities
    once started: it still injects a matching root-owned process."""
    from tests.e2e.test_daemon import Daemon, value

    wanted = make_python("trixie-3.13")
    proc, pid = wanted.start_workload()
    config = tmp_path / "tramprof.toml"
    config.write_text(f'inject_comm = ["python3.13"]\ninject_runtime_dir = "{runtime_dir}"\n'
                      "inject_interval = 0.1\n")
    d = Daemon("--config", str(config), "--pid", str(pid), "--interval", "0.5",
               "--frequency", "199")
    try:
        # The stack series of /metrics admit the first stacks seen (from
        # before the injection) and keep them: the folded profile holds all.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not _named(d.get("/profile"))[0]:
            time.sleep(0.5)
        drains = value(d.metrics(), "tramprof_drains_total")
        before = _named(d.get("/profile"))
        d.wait_for_drains(drains + 4)
        after = _named(d.get("/profile"))
        injected = d.metrics().get(("tramprof_injections_total", (("result", "ok"),)), 0)
        status = Path(f"/proc/{d.proc.pid}/status").read_text()
    finally:
        d.stop()
        finish(proc)
    assert injected == 1, d.log_tail()
    named, total = after[0] - before[0], after[1] - before[1]
    unnamed = (after[2] - before[2]).most_common(5)
    assert total > 100 and named >= 0.9 * total, (named, total, unnamed, d.log_tail())
    assert "Uid:\t65534" in status  # it really had dropped to nobody


def _named(folded: str) -> tuple[int, int, Counter[str]]:
    """(samples whose stack holds the workload's Python chain, all samples,
    the other stacks with their samples)."""
    named = total = 0
    other: Counter[str] = Counter()
    for line in folded.splitlines():
        stack, _, count = line.rpartition(" ")
        total += int(count)
        if CHAIN.search(stack):
            named += int(count)
        else:
            other[stack] += int(count)
    return named, total, other
