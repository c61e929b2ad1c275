"""Fixtures for the injection tier: real interpreters in their own roots and
PID namespaces, started without any profiling flag, and the injectable
runtime built once on the oldest glibc (Debian 11) and cached."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tramprof.inject.injector import default_runtime_dir

from . import namespaces
from .namespaces import roots

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
BUILDER = REPO / "trampolines" / "build_runtimes.py"
BUILD_ROOT = "bullseye"   # oldest glibc here (2.31)
# name -> (root or None for the host, interpreter, version)
INTERPRETERS = {
    "bullseye-3.9": ("bullseye", "python3.9", (3, 9)),
    "host-3.11": (None, "/usr/bin/python3.11", (3, 11)),
    "trixie-3.13": ("trixie", "python3.13", (3, 13)),
    "sid-3.14": ("sid", "python3.14", (3, 14)),
    "sid315-3.15": ("sid315", "python3.15", (3, 15)),
}

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: ptrace, chroots")


def build_runtimes() -> Path:
    """The prebuilt runtimes, built as a release is (trampolines/build_runtimes.py
    in the Debian 11 root) into the daemon's package data, where `tramprof
    inject` and the daemon look by default; up to date sources build nothing."""
    root = roots.ensure_root(BUILD_ROOT)
    proc = subprocess.run([sys.executable, str(BUILDER), "--root", str(root)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return default_runtime_dir()


@pytest.fixture(scope="session")
def runtime_dir() -> Path:
    if os.geteuid() != 0:
        pytest.skip("building in the bullseye root needs root")
    return build_runtimes()


@dataclass
class Python:
    name: str
    root: str | None
    python: str
    version: tuple[int, int]
    workdir: str        # as the interpreter sees it

    def host_path(self, path: str) -> Path:
        return roots.root_path(self.root) / path.lstrip("/") if self.root else Path(path)

    @property
    def workload(self) -> str:
        return f"{self.workdir}/workload.py"

    def start(self, *args: str, options: tuple[str, ...] = (),
              env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
        proc, pid = namespaces.start(self.root, [self.python, *options, *args], env)
        return proc, pid

    def start_workload(self, threads: int = 3, seconds: float = 60,
                       options: tuple[str, ...] = (), env: dict[str, str] | None = None
                       ) -> tuple[subprocess.Popen[str], int]:
        proc, pid = self.start(self.workload, str(threads), str(seconds), options=options,
                               env=env)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
        return proc, pid


def finish(proc: subprocess.Popen[str]) -> str:
    """Ask the workload to stop; its output (it must exit 0)."""
    out, err = proc.communicate("stop\n", timeout=120)
    assert proc.returncode == 0, err[-4000:]
    assert err == "", err[-4000:]
    return out


_made: list[Python] = []


def make_python(name: str) -> Python:
    root, python, version = INTERPRETERS[name]
    if root is not None:
        if shutil.which("debootstrap") is None and not roots.is_ready(root):
            pytest.skip("debootstrap is not installed")
        try:
            roots.ensure_root(root)
        except RuntimeError as exc:
            pytest.skip(f"root {root} unavailable: {exc}")
    elif not Path(python).exists():
        pytest.skip(f"{python} is not installed")
    workdir = f"/tmp/tramprof-inject-tests-{uuid.uuid4().hex[:8]}"
    interp = Python(name, root, python, version, workdir)
    interp.host_path(workdir).mkdir(parents=True)
    shutil.copy(HERE / "workload.py", interp.host_path(interp.workload))
    _made.append(interp)
    return interp


@pytest.fixture(scope="session", autouse=True)
def _cleanup() -> Iterator[None]:
    started = time.time()
    yield
    for interp in _made:
        shutil.rmtree(interp.host_path(interp.workdir), ignore_errors=True)
        # What the targets wrote (perf maps: pid 1 in their namespaces) and
        # what an injector killed on purpose left behind.
        tmp = interp.host_path("/tmp")
        for path in [*tmp.glob("perf-*.map"), *tmp.glob("tramprof-inject-*")]:
            try:
                if path.lstat().st_mtime >= started - 1:
                    shutil.rmtree(path) if path.is_dir() else path.unlink()
            except OSError:
                pass


@pytest.fixture(scope="session", params=list(INTERPRETERS))
def python(request: pytest.FixtureRequest) -> Python:
    return make_python(request.param)
