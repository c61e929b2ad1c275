"""Fixtures for tramprof_trampolines: real interpreters with the runtime installed.

Every test that executes the C runtime does so in a child interpreter
(``-X faulthandler``), so a crash is reported with its signal and stderr
instead of killing pytest.

Interpreters:
- ``host``: the system /usr/bin/python3 (3.11 on Debian 12, 3.13 on 13); the runtime is built from a
  copy of trampolines/ and installed with ``pip install --user`` into a
  per-session PYTHONUSERBASE (the .pth file is live there).
- ``trixie-3.13``, ``bullseye-3.9``, ``sid-3.14``: Debian chroots from
  roots.py (created on first use, cached in /var/cache/tramprof-test/roots),
  the runtime built inside with that root's python. Skipped unless root.
  ``TRAMPROF_TEST_ROOTS_NAMES`` (comma separated, or "none") limits them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SOURCE = REPO / "trampolines"
SCRIPTS = HERE / "scripts"
HOST_PYTHON = "/usr/bin/python3"
PERF_LINE = re.compile(r"^([0-9a-f]+) ([0-9a-f]+) (py::.+)$")

sys.path.insert(0, str(HERE))
import roots  # noqa: E402

ROOT_INTERPS = {"trixie": "python3.13", "bullseye": "python3.9", "sid": "python3.14",
                "sid315": "python3.15"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "roots: runs in Debian chroots (root, debootstrap)")


def _copy_source(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(SOURCE, dest, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", "*.so", "dist"))


@dataclass
class Interp:
    """A Python interpreter with tramprof_trampolines installed."""

    name: str
    python: str                 # as seen by the interpreter
    root: str | None            # roots.py name, None for the host
    host_prefix: Path           # host path of the interpreter's "/"
    workdir: str                # scratch dir as seen by the interpreter
    env: dict[str, str] = field(default_factory=dict)
    version: tuple[int, int] = (0, 0)
    pids: list[int] = field(default_factory=list)  # every child started, for cleanup

    def host_path(self, path: str) -> Path:
        """Host path of *path* as seen by the interpreter."""
        return self.host_prefix / path.lstrip("/") if self.root else Path(path)

    @property
    def scripts(self) -> str:
        return self.workdir + "/scripts"

    def script(self, name: str) -> str:
        return f"{self.scripts}/{name}"

    def argv(self, *args: str) -> list[str]:
        return [self.python, "-X", "faulthandler", *args]

    def _command(self, argv: list[str], env: dict[str, str] | None, cwd: str | None,
                 ) -> tuple[list[str], dict[str, str], str | None]:
        full_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                    "PYTHONDONTWRITEBYTECODE": "1", **self.env, **(env or {})}
        if self.root is None:
            return argv, full_env, cwd
        return roots.root_command(self.root, argv, cwd=cwd or "/"), full_env, None

    def run(self, *args: str, env: dict[str, str] | None = None, cwd: str | None = None,
            timeout: float = 300, input: str | None = None, python_args: bool = True,
            ) -> subprocess.CompletedProcess[str]:
        argv = self.argv(*args) if python_args else list(args)
        command, full_env, host_cwd = self._command(argv, env, cwd)
        with subprocess.Popen(command, env=full_env, cwd=host_cwd, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:
            self.pids.append(proc.pid)
            try:
                stdout, stderr = proc.communicate(input, timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)

    def popen(self, *args: str, env: dict[str, str] | None = None,
              cwd: str | None = None, wrapper: Sequence[str] = ()) -> subprocess.Popen[str]:
        """The interpreter with ``args``; ``wrapper`` is a host command that
        execs the rest (e.g. ``setarch``), so its pid is the interpreter's."""
        command, full_env, host_cwd = self._command(self.argv(*args), env, cwd)
        proc = subprocess.Popen([*wrapper, *command], env=full_env, cwd=host_cwd,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.pids.append(proc.pid)
        return proc

    def perf_map(self, pid: int) -> Path:
        return self.host_path(f"/tmp/perf-{pid}.map")


def check(proc: subprocess.CompletedProcess[str], what: str = "interpreter") -> str:
    """stdout of a finished child; fails the test with signal and stderr otherwise."""
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        pytest.fail(f"{what} killed by {name}\n--- stderr ---\n{proc.stderr[-6000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-3000:]}"
                    f"\n--- stderr ---\n{proc.stderr[-6000:]}")
    return proc.stdout


def read_perf_map(path: Path) -> list[tuple[int, int, str]]:
    """Strictly parsed CPython-format lines: (address, size, name)."""
    entries = []
    for line in path.read_text().splitlines():
        match = PERF_LINE.match(line)
        assert match, f"malformed perf map line {line!r} in {path}"
        entries.append((int(match.group(1), 16), int(match.group(2), 16), match.group(3)))
    return entries


def _install(interp: Interp) -> None:
    """Build and install the runtime for *interp* from a fresh copy of the source."""
    src = interp.workdir + "/src"
    _copy_source(interp.host_path(src))
    scripts = interp.host_path(interp.scripts)
    if scripts.exists():
        shutil.rmtree(scripts)
    shutil.copytree(SCRIPTS, scripts, ignore=shutil.ignore_patterns("__pycache__"))
    pip_env = {"PIP_BREAK_SYSTEM_PACKAGES": "1", "PIP_ROOT_USER_ACTION": "ignore"}
    if interp.run("-c", "import _cffi_backend").returncode != 0:
        # No distribution build of cffi for this interpreter: from PyPI.
        check(interp.run("-m", "pip", "install", "-q", "--user", "--ignore-installed",
                         "--disable-pip-version-check", "cffi", env=pip_env,
                         cwd=interp.workdir, timeout=900), f"pip install cffi into {interp.name}")
    proc = interp.run("-m", "pip", "install", "-q", "--user", "--no-build-isolation",
                      "--no-deps", "--disable-pip-version-check", src,
                      env=pip_env, cwd=interp.workdir, timeout=600)
    check(proc, f"pip install into {interp.name}")
    out = check(interp.run("-c", "import sys, tramprof_trampolines; "
                                 "print('%d %d' % sys.version_info[:2])"))
    major, minor = out.split()
    interp.version = (int(major), int(minor))


SESSION_START = time.time()


def _remove_artifacts(interp: Interp) -> None:
    """Delete the perf maps and jitdumps this session's children wrote: those
    of the pids it started, and those naming files in its private work dir
    (fork children, perf record). Nobody else's files are touched."""
    tmp = interp.host_path("/tmp")
    candidates = {tmp / f"{kind}-{pid}.{ext}" for pid in interp.pids
                  for kind, ext in (("perf", "map"), ("jit", "dump"))}
    marker = (interp.workdir + "/").encode()
    for path in [*tmp.glob("perf-*.map"), *tmp.glob("jit-*.dump")]:
        try:
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode) or info.st_mtime < SESSION_START - 1:
                continue
            if path in candidates or marker in path.read_bytes():
                path.unlink()
        except OSError:
            pass


_interps: list[Interp] = []


@pytest.fixture(scope="session", autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    for interp in _interps:
        _remove_artifacts(interp)
        if interp.root is not None:
            shutil.rmtree(interp.host_path(interp.workdir), ignore_errors=True)


def _roots_enabled() -> list[str]:
    names = os.environ.get("TRAMPROF_TEST_ROOTS_NAMES", ",".join(ROOT_INTERPS))
    return [n for n in names.split(",") if n in ROOT_INTERPS]


@pytest.fixture(scope="session")
def host_interp(tmp_path_factory: pytest.TempPathFactory) -> Interp:
    if not Path(HOST_PYTHON).exists():
        pytest.skip(f"{HOST_PYTHON} is not installed")
    work = tmp_path_factory.mktemp("host")
    interp = Interp("host", HOST_PYTHON, None, Path("/"), str(work),
                    env={"PYTHONUSERBASE": str(work / "userbase")})
    _interps.append(interp)
    _install(interp)
    return interp


_root_interps: dict[str, Interp] = {}


def root_interp(name: str) -> Interp:
    if name in _root_interps:
        return _root_interps[name]
    if os.geteuid() != 0:
        pytest.skip("chroots need root")
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is not installed")
    try:
        path = roots.ensure_root(name)
    except RuntimeError as exc:  # e.g. the suite has no such python package
        pytest.skip(f"root {name} unavailable: {exc}")
    workdir = f"/tmp/tramprof-tests-{uuid.uuid4().hex[:8]}"
    interp = Interp(f"{name}-{ROOT_INTERPS[name][len('python'):]}", ROOT_INTERPS[name], name, path,
                    workdir, env={"PYTHONUSERBASE": workdir + "/userbase"})
    interp.host_path(workdir).mkdir(parents=True)
    _interps.append(interp)
    _install(interp)
    _root_interps[name] = interp
    return interp


@pytest.fixture(scope="session", params=[
    "host", *(pytest.param(name, marks=pytest.mark.roots) for name in _roots_enabled())])
def interp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Interp:
    """Each available interpreter in turn (host 3.11 first)."""
    if request.param == "host":
        return request.getfixturevalue("host_interp")
    return root_interp(request.param)


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[str]]]:
    """Popen objects to kill at the end of the test."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
