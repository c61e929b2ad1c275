"""Complete Python stacks on a Python without frame pointers: the profiler
walks the trampoline runtime's chain in BPF (root; Debian's python3.11)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tramprof.folded import parse_folded

from .conftest import Interp

TRAMPROF = str(Path(sys.executable).parent / "tramprof")
ON = {"TRAMPROF_TRAMPOLINES": "1"}
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
]


def record(pid: int, seconds: float = 3, frequency: int = 499) -> dict[tuple[str, ...], int]:
    out = subprocess.run([TRAMPROF, "record", "--pid", str(pid), "--duration", str(seconds),
                          "--frequency", str(frequency)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return dict(parse_folded(out))


def python_frames(stack: tuple[str, ...]) -> list[str]:
    """Function names of the Python frames (perf map names py::QUALNAME:FILE)."""
    return [f[4:].split(":", 1)[0] for f in stack[1:] if f.startswith("py::")]


def start(interp: Interp, *args: str) -> subprocess.Popen[str]:
    proc = interp.popen(interp.script("nesting.py"), *args, env=ON)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def share(stacks: dict[tuple[str, ...], int], good) -> float:  # type: ignore[no-untyped-def]
    total = sum(stacks.values())
    assert total > 500, f"too few samples: {total}"
    return sum(c for s, c in stacks.items() if good(s)) / total


def stop(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait()


def test_exact_python_chain(host_interp: Interp) -> None:
    proc = start(host_interp, "chain", "30")
    try:
        stacks = record(proc.pid)
    finally:
        stop(proc)
    exact = share(stacks, lambda s: python_frames(s) == ["<module>", "main", "outer",
                                                          "middle", "inner", "leaf"])
    assert exact >= 0.95, sorted(stacks.items(), key=lambda kv: -kv[1])[:3]


def test_recursion_200_deep_is_complete(host_interp: Interp) -> None:
    proc = start(host_interp, "recurse", "30", "200")
    try:
        stacks = record(proc.pid)
    finally:
        stop(proc)
    complete = share(stacks, lambda s: python_frames(s) == [
        "<module>", "main", *["descend"] * 200, "leaf"])
    assert complete >= 0.95, [(python_frames(s)[:4], len(python_frames(s)), c)
                              for s, c in sorted(stacks.items(), key=lambda kv: -kv[1])[:3]]


def test_threads_each_get_their_own_chain(host_interp: Interp) -> None:
    proc = start(host_interp, "threads", "30")
    try:
        stacks = record(proc.pid)
    finally:
        stop(proc)
    # Both threads run at once on 2 CPUs; each stack is one thread's own chain.
    thread_chain = ["Thread._bootstrap", "Thread._bootstrap_inner", "Thread.run"]
    alpha = share(stacks, lambda s: python_frames(s) == [*thread_chain, "alpha_work", "leaf"])
    beta = share(stacks, lambda s: python_frames(s) == [*thread_chain, "beta_work", "leaf"])
    assert alpha + beta >= 0.95 and min(alpha, beta) >= 0.3, \
        sorted(((python_frames(s), c) for s, c in stacks.items()), key=lambda kv: -kv[1])[:4]


def test_native_leaf_under_the_calling_python_frame(host_interp: Interp) -> None:
    proc = start(host_interp, "zlib", "30")
    try:
        stacks = record(proc.pid)
    finally:
        stop(proc)

    def in_zlib(stack: tuple[str, ...]) -> bool:
        py = python_frames(stack)
        if py[-2:] != ["main", "compress_loop"]:
            return False
        below = stack[stack.index(next(f for f in stack if f.startswith("py::compress_loop"))) + 1:]
        # The work happens in zlib's deflate code, named from libz's symbols.
        return any(f.startswith(("deflate", "longest_match", "compress")) or "libz" in f
                   for f in below)

    assert share(stacks, in_zlib) >= 0.5, sorted(stacks.items(), key=lambda kv: -kv[1])[:4]
