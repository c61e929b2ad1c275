"""Complete Python stacks for CPython 3.13 ``-X perf`` (stubs we do not
control) on a Python without frame pointers: the profiler scans the stack for
the stubs' return addresses ("scan" mode; root, Debian trixie's python3.13)."""

from __future__ import annotations

import os
import subprocess

import pytest

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
