"""Shared fixtures: test targets compiled at test time, root detection."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# CI runs the property tests with a fixed sequence of examples, so a run is
# reproducible; locally every run draws new examples and keeps finding bugs.
settings.register_profile("ci", derandomize=True, deadline=None, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

REPO = Path(__file__).resolve().parent.parent
TARGETS_SRC = REPO / "tests" / "targets"
VENV_BIN = Path(sys.executable).parent
TRAMPROF = str(VENV_BIN / "tramprof")

IS_ROOT = os.geteuid() == 0
requires_root = pytest.mark.skipif(
    not IS_ROOT, reason="needs root: loads BPF programs and reads other processes' memory")


@pytest.fixture
def sleepers() -> Iterator[list[int]]:
    """Two running ``sleep`` programs (pids), their libraries mapped."""
    from tramprof.procfs.maps import read_maps

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        for p in procs:  # the dynamic loader maps libc just after exec
            deadline = time.monotonic() + 5
            while not any(m.basename.startswith("libc.so") for m in read_maps(p.pid)):
                assert time.monotonic() < deadline, "sleep never mapped libc"
                time.sleep(0.01)
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="session")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every tests/targets/*.c built with frame pointers, -O2."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed")
    out = tmp_path_factory.mktemp("targets")
    for source in sorted(TARGETS_SRC.glob("*.c")):
        subprocess.run(["gcc", "-O2", "-g", "-fno-omit-frame-pointer", "-o",
                        str(out / source.stem), str(source)], check=True)
    return out


class Target:
    """A running target program, killed when the test ends."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            self.stop()
            raise RuntimeError(f"target {argv} did not start: {line!r}")
        #: What the target printed after "ready" (e.g. an address).
        self.ready_info = line.split()[1:]
        #: When it said so (monotonic seconds): its start-up lies before.
        self.ready_at = time.monotonic()

    def go(self) -> None:
        """Release a target that waits for a line on stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        # A target killed mid-run leaves the perf map it wrote (tests/targets/jit.c).
        Path(f"/tmp/perf-{self.proc.pid}.map").unlink(missing_ok=True)


@pytest.fixture
def start_target() -> Iterator[object]:
    started: list[Target] = []

    def start(*argv: str) -> Target:
        target = Target(list(argv))
        started.append(target)
        return target

    yield start
    for target in started:
        target.stop()
