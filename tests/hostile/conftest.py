"""The hostile tier: attacks run as an unprivileged user next to a
well-behaved target, against a real daemon (root)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import IS_ROOT

ATTACKER = "tramprof-attacker"
ATTACKERS = Path(__file__).parent / "attackers"


@pytest.fixture(scope="session")
def attacker_user() -> pwd.struct_passwd:
    """An unprivileged user of its own, created once per machine."""
    if not IS_ROOT:
        pytest.skip("needs root: creates a user and loads BPF programs")
    try:
        return pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                        ATTACKER], check=True)
        return pwd.getpwnam(ATTACKER)


@pytest.fixture(scope="session")
def attacker_dir(attacker_user: pwd.struct_passwd) -> Iterator[Path]:
    """A directory the attacker owns, with the attacker programs in it (in
    /tmp itself: pytest keeps its own temporary directories private)."""
    d = Path(tempfile.mkdtemp(prefix="tramprof-attacker-"))
    shutil.copy(ATTACKERS / "attacker.py", d / "attacker.py")
    runtime = d / "tramprof_trampolines"
    runtime.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(runtime / "_runtime.so"),
                    str(ATTACKERS / "lying_runtime.c")], check=True)
    for path in (d, *d.rglob("*")):
        os.chown(path, attacker_user.pw_uid, attacker_user.pw_gid)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Attacker:
    """One attacker process, running as the unprivileged user."""

    def __init__(self, user: pwd.struct_passwd, directory: Path, *argv: str) -> None:
        self.proc = subprocess.Popen(
            ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
             "--", "/usr/bin/python3", str(directory / "attacker.py"),
             *argv],
            cwd=directory, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"attacker {argv} did not start: {line!r} "
                               f"{self.proc.stderr.read() if self.proc.stderr else ''}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for name in (f"/tmp/perf-{self.proc.pid}.map", f"/tmp/jit-{self.proc.pid}.dump"):
            Path(name).unlink(missing_ok=True)


@pytest.fixture
def attack(attacker_user: pwd.struct_passwd, attacker_dir: Path) -> Iterator[object]:
    started: list[Attacker] = []

    def start(*argv: str) -> Attacker:
        attacker = Attacker(attacker_user, attacker_dir, *argv)
        started.append(attacker)
        return attacker

    yield start
    for attacker in started:
        attacker.stop()
