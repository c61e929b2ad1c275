"""Native frames between Python frames on Debian's python3.11 (built without
frame pointers) under the trampoline runtime: chain mode for the Python
frames, unwind tables for the native ones (root; real interpreter)."""

from __future__ import annotations

import os
import subprocess

import pytest
from tramprof.model import NATIVE_GAP

from tests.tables import Stacks, profile, share, top

from .conftest import Interp

ON = {"TRAMPROF_TRAMPOLINES": "1"}
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
]


def start(interp: Interp, *args: str) -> subprocess.Popen[str]:
    proc = interp.popen(interp.script("nesting.py"), *args, env=ON)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
    return proc


def python_name(frame: str) -> str | None:
    return frame[4:].split(":", 1)[0] if frame.startswith("py::") else None


def between(stack: tuple[str, ...], caller: str, callee: str) -> list[str] | None:
    """The native frames between two Python frames (None: not both there)."""
    names = [python_name(f) for f in stack]
    if caller not in names or callee not in names[names.index(caller):]:
        return None
    at = names.index(caller)
    end = names.index(callee, at)
    return list(stack[at + 1:end])


def profiled(interp: Interp, mode: str, good) -> Stacks:  # type: ignore[no-untyped-def]
    proc = start(interp, mode, "300")
    try:
        stacks, _stats, _mode = profile(proc.pid, good, seconds=4)
    finally:
        proc.kill()
        proc.wait()
    return stacks


def test_zlib_native_frames_under_the_python_caller(host_interp: Interp) -> None:
    def in_zlib(stack: tuple[str, ...]) -> bool:
        return "compress_loop" in map(python_name, stack) and any(
            f.startswith("deflate") for f in stack)

    stacks = profiled(host_interp, "zlib", lambda s: in_zlib(s) and NATIVE_GAP not in s)
    compressing = Stacks({s: c for s, c in stacks.items() if in_zlib(s)})
    assert sum(compressing.values()) >= 100, top(stacks)
    assert share(compressing, lambda s: NATIVE_GAP not in s) >= 0.95, top(compressing)
    # The interpreter's own frames lead from the Python caller down to zlib.
    assert share(compressing, lambda s: "PyObject_Vectorcall" in s) >= 0.95, top(compressing)


def test_sorted_stands_between_the_caller_and_the_key_function(host_interp: Interp) -> None:
    def complete(stack: tuple[str, ...]) -> bool:
        natives = between(stack, "sort_loop", "sort_key")
        return bool(natives) and NATIVE_GAP not in stack

    stacks = profiled(host_interp, "sorted", complete)
    in_key = Stacks({s: c for s, c in stacks.items()
                     if between(s, "sort_loop", "sort_key") is not None})
    assert sum(in_key.values()) >= 100, top(stacks)
    assert share(in_key, complete) >= 0.95, top(in_key)
    # sorted() is a C function the Python caller called and that calls the key:
    # the interpreter's call path into C is there, with list.sort's frames.
    assert share(in_key, lambda s: "PyObject_Vectorcall" in between(s, "sort_loop", "sort_key")
                 ) >= 0.95, top(in_key)


def test_thread_roots_are_exact(host_interp: Interp) -> None:
    """Every thread's stack starts at its real native root (clone3 for the
    worker threads), the same for all their samples: one logical stack is
    one stack, not several towers with [unknown] roots."""
    def first_python(stack: tuple[str, ...]) -> int:
        return next((i for i, f in enumerate(stack) if python_name(f)), len(stack))

    def worker(stack: tuple[str, ...]) -> bool:
        return bool({"alpha_work", "beta_work"} & set(map(python_name, stack)))

    def rooted(stack: tuple[str, ...]) -> bool:
        return worker(stack) and stack[0] in ("clone3", "clone") and not any(
            f.startswith("[") for f in stack[:first_python(stack)])

    stacks = profiled(host_interp, "threads", rooted)
    workers = Stacks({s: c for s, c in stacks.items() if worker(s)})
    assert sum(workers.values()) >= 200, top(stacks)
    assert share(workers, rooted) >= 0.95, top(workers)
    roots = Stacks()
    for stack, count in workers.items():
        roots[stack[:first_python(stack)]] += count
    _root, count = roots.most_common(1)[0]
    assert count / sum(roots.values()) >= 0.95, roots.most_common(3)
