"""The runtime as a wheel: built once per interpreter where a compiler is
(``pip wheel ./trampolines``), installed where none is.

For the host's python3 and each Debian root (3.9, 3.13, 3.14, 3.15): the
wheel is built in the root and cached under
``/var/cache/tramprof-test/trampoline-wheels/<source hash>/<root>``, then
installed into a fresh venv with no compiler reachable (PATH holds nothing,
CC names no file, no index, no build isolation) and activated through its
.pth file: a real perf map must name a stub of a function the probe ran.
This is the second stage of the multi-stage image build in
trampolines/README.md.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import HOST_PYTHON, ROOT_INTERPS, SOURCE, _roots_enabled, read_perf_map, roots

CACHE = Path(os.environ.get("TRAMPROF_TEST_CACHE", "/var/cache/tramprof-test"))
WHEELS = CACHE / "trampoline-wheels"
SKIP_PARTS = {"build", "dist", "__pycache__"}
PROBE = '''
import json, os, sys
import tramprof_trampolines as t

def work():
    return sum(range(1000))

work()
print(json.dumps({"pid": os.getpid(), "file": t.__file__, "active": t.is_active(),
                  "map": t.perf_map_path(), "stub": t.stub_address(work.__code__),
                  "prefix": sys.prefix}))
'''
pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 stubs only")


def source_hash() -> str:
    """Of every file a wheel is built from (build outputs left out)."""
    digest = hashlib.sha256()
    for path in sorted(SOURCE.rglob("*")):
        relative = path.relative_to(SOURCE)
        if (path.is_dir() or SKIP_PARTS & set(relative.parts) or path.suffix == ".so"
                or any(part.endswith(".egg-info") for part in relative.parts)):
            continue
        digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass
class Place:
    """Where commands run: the host, or a Debian root (chroot)."""

    name: str
    python: str
    root: str | None

    def host_path(self, path: str) -> Path:
        return roots.root_path(self.root) / path.lstrip("/") if self.root else Path(path)

    def run(self, argv: list[str], env: dict[str, str], timeout: float = 900
            ) -> subprocess.CompletedProcess[str]:
        full = {"LANG": "C.UTF-8", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                "PIP_NO_CACHE_DIR": "1", "PIP_ROOT_USER_ACTION": "ignore", **env}
        if self.root is None:
            return subprocess.run(argv, env=full, capture_output=True, text=True,
                                  timeout=timeout)
        # The chroot's own env sets the command's environment; the host's
        # tools (unshare, mount, chroot) run with the host's PATH.
        inside = ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in full.items()), *argv]
        return subprocess.run(roots.root_command(self.root, inside),
                              env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
                              capture_output=True, text=True, timeout=timeout)

    def check(self, argv: list[str], env: dict[str, str], what: str) -> str:
        proc = self.run(argv, env)
        assert proc.returncode == 0, f"{what} in {self.name} failed ({proc.returncode}):\n" \
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        return proc.stdout


BUILD_PATH = "/usr/local/bin:/usr/bin:/bin"


def place(name: str) -> Place:
    if name == "host":
        if not Path(HOST_PYTHON).exists():
            pytest.skip(f"{HOST_PYTHON} is not installed")
        return Place("host", HOST_PYTHON, None)
    if os.geteuid() != 0:
        pytest.skip("chroots need root")
    if not roots.is_ready(name):
        if shutil.which("debootstrap") is None:
            pytest.skip("debootstrap is not installed")
        try:
            roots.ensure_root(name)
        except RuntimeError as exc:
            pytest.skip(f"root {name} unavailable: {exc}")
    return Place(name, ROOT_INTERPS[name], name)


def build_wheels(where: Place) -> Path:
    """The runtime's wheel (and cffi's, where the distribution has no cffi
    for this interpreter), built in ``where`` with its compiler; cached."""
    version = where.check([where.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                          {"PATH": BUILD_PATH}, "python").strip()
    cache = WHEELS / source_hash() / f"{where.name}-{version}"
    WHEELS.mkdir(parents=True, exist_ok=True)
    with open(WHEELS / f".{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if any(cache.glob("tramprof_trampolines-*.whl")):
            return cache
        work = f"/tmp/tramprof-wheel-{uuid.uuid4().hex[:8]}"
        host_work = where.host_path(work)
        shutil.copytree(SOURCE, host_work / "src", ignore=shutil.ignore_patterns(
            "build", "dist", "*.egg-info", "__pycache__", "*.so"))
        env = {"PATH": BUILD_PATH, "HOME": work, "PYTHONUSERBASE": work + "/userbase",
               "PIP_BREAK_SYSTEM_PACKAGES": "1"}
        try:
            began = time.monotonic()
            if where.run([where.python, "-c", "import _cffi_backend"], env).returncode != 0:
                # No distribution cffi for this interpreter: its wheel goes
                # along (built here if PyPI has none), and builds the runtime.
                where.check([where.python, "-m", "pip", "wheel", "-q", "-w", work + "/out",
                             "cffi"], env, "pip wheel cffi")
                where.check([where.python, "-m", "pip", "install", "-q", "--user", "--no-index",
                             "--find-links", work + "/out", "cffi"], env, "pip install cffi")
            where.check([where.python, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                         "--no-deps", "-w", work + "/out", work + "/src"], env, "pip wheel")
            print(f"{where.name}: wheels built in {time.monotonic() - began:.1f} s")
            partial = cache.with_name(cache.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            shutil.copytree(host_work / "out", partial)
            partial.rename(cache)
        finally:
            shutil.rmtree(host_work, ignore_errors=True)
    return cache


@pytest.mark.parametrize("name", [
    "host", *(pytest.param(name, marks=pytest.mark.roots) for name in _roots_enabled())])
def test_wheel_installs_and_activates_without_a_compiler(name: str) -> None:
    where = place(name)
    wheels = build_wheels(where)
    (runtime,) = wheels.glob("tramprof_trampolines-*.whl")
    suffix = where.check([where.python, "-c", "import sysconfig; "
                          "print(sysconfig.get_config_var('EXT_SUFFIX'))"],
                         {"PATH": BUILD_PATH}, "python").strip()
    with zipfile.ZipFile(runtime) as wheel:
        names = set(wheel.namelist())
    # The compiled extension is in the wheel: installing it compiles nothing.
    assert f"tramprof_trampolines/_runtime{suffix}" in names, sorted(names)
    assert {"tramprof_trampolines.pth", "_tramprof_trampolines_boot.py"} <= names

    work = f"/tmp/tramprof-wheel-{uuid.uuid4().hex[:8]}"
    host_work = where.host_path(work)
    (host_work / "empty").mkdir(parents=True)
    shutil.copytree(wheels, host_work / "wheels")
    (host_work / "probe.py").write_text(PROBE)
    # No compiler anywhere: PATH holds an empty directory, CC names no file.
    bare = {"PATH": work + "/empty", "CC": work + "/no-compiler", "HOME": work,
            "PYTHONNOUSERSITE": "1"}
    pid = None
    try:
        began = time.monotonic()
        where.check([where.python, "-m", "venv", "--without-pip", "--system-site-packages",
                     work + "/venv"], {"PATH": BUILD_PATH}, "venv")
        python = work + "/venv/bin/python"
        where.check([python, "-m", "pip", "install", "-q", "--no-index", "--find-links",
                     work + "/wheels", "--no-build-isolation", "tramprof-trampolines"], bare,
                    "pip install without a compiler")
        report = json.loads(where.check([python, work + "/probe.py"],
                                        {**bare, "TRAMPROF_TRAMPOLINES": "1"}, "probe"))
        pid = report["pid"]
        print(f"{where.name}: installed and activated in {time.monotonic() - began:.1f} s")
        assert report["active"] is True
        assert report["prefix"] == work + "/venv"
        assert report["file"].startswith(work + "/venv/lib/"), report
        assert report["map"] == f"/tmp/perf-{pid}.map"
        entries = read_perf_map(where.host_path(report["map"]))
        assert (report["stub"], f"py::work:{work}/probe.py") in \
            {(address, name) for address, _size, name in entries}, entries[:5]
    finally:
        shutil.rmtree(host_work, ignore_errors=True)
        if pid is not None:
            where.host_path(f"/tmp/perf-{pid}.map").unlink(missing_ok=True)
