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

from tests.conftest import IS_ROOT, Target

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


def attacker_argv(user: pwd.struct_passwd, directory: Path, *argv: str) -> list[str]:
    """The command line of one attacker process, run as the unprivileged user."""
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            "--", "/usr/bin/python3", str(directory / "attacker.py"), *argv]


@pytest.fixture
def attack(attacker_user: pwd.struct_passwd, attacker_dir: Path) -> Iterator[object]:
    started: list[Target] = []

    def start(*argv: str) -> Target:
        attacker = Target(attacker_argv(attacker_user, attacker_dir, *argv))
        started.append(attacker)
        return attacker

    yield start
    for attacker in started:
        attacker.stop()
        Path(f"/tmp/jit-{attacker.pid}.dump").unlink(missing_ok=True)
