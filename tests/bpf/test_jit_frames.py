"""JIT code named from perf maps in real sampled stacks (root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.bpf.test_record import record
from tests.conftest import requires_root

pytestmark = requires_root

JIT_NAME = "py::spin:/srv/app/jit target.py"


def test_anonymous_code_is_named_from_the_perf_map(targets, start_target):
    target = start_target(str(targets / "jit"), "30")
    target.go()
    time.sleep(0.2)
    stacks = record(target.pid, 3)
    total = sum(stacks.values())
    assert total > 1500
    exact = sum(count for stack, count in stacks.items()
                if stack[-3:] == ("main", "jit_caller", JIT_NAME))
    assert exact / total >= 0.95, sorted(stacks.items(), key=lambda kv: -kv[1])[:4]


def test_code_in_a_page_that_was_writable_when_first_seen_is_named(targets, start_target):
    """A JIT's new code page is writable until the code is in it (V8 also
    makes pages writable again to patch or move code): the maps read when
    the process was first sampled show it rw-p. The code that runs there
    later is named from the perf map, not [unknown]."""
    # Native code for 5 s (record starts within them, and reads the maps at
    # the first sample), then the JIT code, in the same page made executable.
    target = start_target(str(targets / "jit"), "30", "late", "5")
    target.go()
    stacks = record(target.pid, 8)
    total = sum(stacks.values())
    jit = sum(count for stack, count in stacks.items()
              if stack[-3:] == ("main", "jit_caller", JIT_NAME))
    unknown = sum(count for stack, count in stacks.items() if "[unknown]" in stack)
    assert total > 4000 and jit / total >= 0.25 and unknown <= total * 0.01, \
        sorted(stacks.items(), key=lambda kv: -kv[1])[:4]


def test_stale_map_of_an_earlier_process_names_nothing(targets, start_target):
    """A map left by an earlier process with the same pid (older than this
    process) must not name this process's code."""
    target = start_target(str(targets / "jit"), "30", "nomap")
    address = int(target.ready_info[0], 16)
    stale = Path(f"/tmp/perf-{target.pid}.map")
    stale.write_text(f"{address:x} e stale_function_of_another_process\n")
    past = time.time() - 3600
    os.utime(stale, (past, past))
    try:
        target.go()
        time.sleep(0.2)
        stacks = record(target.pid, 2)
    finally:
        stale.unlink(missing_ok=True)
    assert not any("stale_function" in frame for stack in stacks for frame in stack)
    anon = sum(count for stack, count in stacks.items() if stack[-1] == "[anon]")
    assert anon / sum(stacks.values()) >= 0.95


SPIN_JS = """
function spin(n) { let x = 0; for (let i = 0; i < n; i++) { x = (x * 31 + i) | 0; } return x; }
const until = Date.now() + 30000;
console.log("ready");
while (Date.now() < until) spin(1e6);
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_jit_frames_are_named(tmp_path):
    script = tmp_path / "spin.js"
    script.write_text(SPIN_JS)
    node = subprocess.Popen(["node", "--perf-basic-prof", str(script)], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert node.stdout is not None and node.stdout.readline().strip() == "ready"
        time.sleep(1)  # let V8 optimise spin and write its map line
        stacks = record(node.pid, 3)
    finally:
        node.kill()
        node.wait()
        Path(f"/tmp/perf-{node.pid}.map").unlink(missing_ok=True)
    total = sum(stacks.values())
    # V8 names JS code like "JS:*spin /path/spin.js:2" (optimised) in its map.
    spin = sum(count for stack, count in stacks.items()
               if any(" spin " in f"{frame} " or "*spin" in frame for frame in stack))
    assert total > 1000 and spin / total >= 0.8, sorted(stacks.items(),
                                                         key=lambda kv: -kv[1])[:4]


def test_doctor_explains_perf_map_use(targets, start_target):
    from tests.conftest import TRAMPROF

    target = start_target(str(targets / "jit"), "30")
    target.go()
    time.sleep(0.2)
    out = subprocess.run([TRAMPROF, "doctor", "--pid", str(target.pid)],
                         capture_output=True, text=True, timeout=60).stdout
    assert f"[ok  ] perf map: /proc/{target.pid}/root/tmp/perf-{target.pid}.map: used, " \
           "1 symbols" in out
    assert "1 anonymous executable mappings" in out
    assert "100% of frames in anonymous executable memory named" in out


def test_doctor_explains_a_stale_map(targets, start_target):
    from tests.conftest import TRAMPROF

    target = start_target(str(targets / "jit"), "30", "nomap")
    stale = Path(f"/tmp/perf-{target.pid}.map")
    stale.write_text("1000 10 old\n")
    past = time.time() - 3600
    os.utime(stale, (past, past))
    try:
        out = subprocess.run([TRAMPROF, "doctor", "--pid", str(target.pid),
                              "--sample-seconds", "0"],
                             capture_output=True, text=True, timeout=60).stdout
    finally:
        stale.unlink(missing_ok=True)
    assert "perf map" in out and "not used (stale)" in out
    assert "left by an earlier process" in out


def test_a_fifo_at_the_perf_map_path_does_not_stop_record(targets, start_target):
    """A process with anonymous executable memory is a candidate for every
    trampoline mode; a FIFO planted where its perf map would be must be
    refused without blocking, and the profile must still come out on time."""
    target = start_target(str(targets / "jit"), "30", "nomap")
    fifo = Path(f"/tmp/perf-{target.pid}.map")
    fifo.unlink(missing_ok=True)  # left by an earlier process with this pid
    os.mkfifo(fifo, 0o644)
    try:
        target.go()
        time.sleep(0.2)
        began = time.monotonic()
        stacks = record(target.pid, 2)
        took = time.monotonic() - began
    finally:
        fifo.unlink(missing_ok=True)
    # Start-up (BPF compile, kallsyms) takes a few seconds; a hang never ends.
    assert took < 30, took
    anon = sum(count for stack, count in stacks.items()
               if stack[-2:] == ("jit_caller", "[anon]"))
    assert anon / sum(stacks.values()) >= 0.95, sorted(stacks.items(), key=lambda kv: -kv[1])[:4]
