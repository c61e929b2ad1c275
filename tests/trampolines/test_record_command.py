"""``tramprof record -- COMMAND``: the command starts with the trampoline
runtime activated (TRAMPROF_TRAMPOLINES=1 from record, the runtime installed
in the interpreter's user site), is profiled with its children until it
exits, and its exit status becomes record's (root; Debian's python3)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tramprof.export.formats.folded import parse_folded

from .conftest import Interp

TRAMPROF = str(Path(sys.executable).parent / "tramprof")
CHAIN = ["<module>", "main", "outer", "middle", "inner", "leaf"]
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: loads BPF programs"),
    pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only"),
]


def python_frames(stack: tuple[str, ...]) -> list[str]:
    return [f[4:].split(":", 1)[0] for f in stack[1:] if f.startswith("py::")]


def record_command(interp: Interp, tmp_path: Path, *command: str, frequency: int = 499,
                   ) -> tuple[subprocess.CompletedProcess[str], dict[tuple[str, ...], int]]:
    out = tmp_path / "out.folded"
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           **interp.env}  # PYTHONUSERBASE: where the runtime is installed
    assert "TRAMPROF_TRAMPOLINES" not in env
    proc = subprocess.run([TRAMPROF, "record", "-F", str(frequency), "-o", str(out), "--",
                           *command], env=env, capture_output=True, text=True, timeout=180)
    stacks = dict(parse_folded(out.read_text())) if out.exists() else {}
    return proc, stacks


def shares(stacks: dict[tuple[str, ...], int], *chains: list[str]) -> tuple[float, ...]:
    """Share of all samples that have Python frames, then of those, the share
    of each chain (exactly these Python frames)."""
    total = sum(stacks.values())
    assert total > 0
    python = {s: c for s, c in stacks.items() if python_frames(s)}
    with_python = sum(python.values())
    assert with_python > 0, sorted(stacks.items(), key=lambda kv: -kv[1])[:5]
    return (with_python / total, *(sum(c for s, c in python.items() if python_frames(s) == chain)
                                   / with_python for chain in chains))


def test_python_command_runs_with_trampolines_until_it_exits(host_interp: Interp,
                                                             tmp_path: Path) -> None:
    # 8 s of work: what is not walked is the start-up, until the runtime is
    # found (~0.1 s here, over 1 s once on a loaded CI machine).
    began = time.monotonic()
    proc, stacks = record_command(host_interp, tmp_path, host_interp.python,
                                  host_interp.script("nesting.py"), "chain", "8")
    elapsed = time.monotonic() - began
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ready\n"  # the command's own output, untouched
    assert "cannot import tramprof_trampolines" not in proc.stderr
    # One busy thread for 8 s at 499 Hz: ~4000 samples at most (fewer on a
    # shared CPU).
    assert sum(stacks.values()) <= 4200, sum(stacks.values())
    # Debian's python3.11 has no frame pointers: Python frames come only from
    # the runtime's chain, so they show it was activated. Only the
    # interpreter's start-up, before the .pth activates it, has none.
    covered, exact = shares(stacks, CHAIN)
    unwalked = sorted(((s, c) for s, c in stacks.items() if not python_frames(s)),
                      key=lambda kv: -kv[1])
    assert covered >= 0.8 and exact >= 0.95, \
        (covered, exact, sum(stacks.values()), elapsed, unwalked[:3])
    # Ended with the command: 8 s of work plus BPF compilation, not a fixed duration.
    assert elapsed < 8 + 60, elapsed


def test_children_are_followed_and_the_status_is_the_commands(host_interp: Interp,
                                                               tmp_path: Path) -> None:
    """A shell starts two Pythons (one in the background), each with its own
    work; both are profiled with complete chains; the shell's exit status 7
    is record's."""
    python = shlex.quote(host_interp.python)
    script = shlex.quote(host_interp.script("nesting.py"))
    shell = f"{python} {script} chain 3 & {python} {script} mix 3; wait; exit 7"
    proc, stacks = record_command(host_interp, tmp_path, "/bin/sh", "-c", shell)
    assert proc.returncode == 7, proc.stderr
    mix = [["<module>", "main", "mix", work, "spin"] for work in ("work_a", "work_b", "work_c")]
    covered, chain, *works = shares(stacks, CHAIN, *mix)
    # Each process had one CPU-bound thread for 3 s: about half each.
    assert covered >= 0.8 and chain >= 0.3 and sum(works) >= 0.3, \
        (covered, chain, works, sorted(stacks.items(), key=lambda kv: -kv[1])[:5])
    assert chain + sum(works) >= 0.95, (chain, works)


def test_signal_status_and_missing_command(host_interp: Interp, tmp_path: Path) -> None:
    proc, _ = record_command(host_interp, tmp_path, host_interp.python, "-c",
                             "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert proc.returncode == 128 + 15, proc.stderr
    proc, _ = record_command(host_interp, tmp_path, "/nonexistent/command")
    assert proc.returncode == 127
    assert proc.stderr.strip() == "tramprof: /nonexistent/command: command not found"


def test_python_without_the_runtime_is_named(tmp_path: Path) -> None:
    """Without the runtime in the interpreter, record says so (and runs it)."""
    env = {"PATH": "/usr/bin:/bin", "PYTHONNOUSERSITE": "1"}
    out = tmp_path / "out.folded"
    proc = subprocess.run([TRAMPROF, "record", "-o", str(out), "--", "/usr/bin/python3", "-c",
                           "print('ran')"], env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ran\n"
    assert "tramprof: /usr/bin/python3 cannot import tramprof_trampolines" in proc.stderr
