"""Debian chroots with other CPython versions, for testing tramprof_trampolines.

Roots are cached outside the repository under ``/var/cache/tramprof-test/roots/<name>``
(override with ``TRAMPROF_TEST_ROOTS``). Creation is idempotent and safe against
concurrent callers: a per-root ``flock`` serialises builders, a root is built in
``<name>.partial`` and renamed into place only when debootstrap succeeded, and a
stamp file records how long it took.

Commands run inside with :func:`run_in_root`: a private mount namespace
(``unshare --mount --propagation private``) gets ``/proc`` and ``/dev`` mounted
inside the root, then ``chroot``. The mounts disappear with the namespace when
the command exits, so a crashed test never leaves mounts behind.

Usable as a script: ``python tests/trampolines/roots.py create trixie``.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("TRAMPROF_TEST_ROOTS", "/var/cache/tramprof-test/roots"))
PACKAGES = ["python3", "python3-dev", "python3-cffi", "python3-pip", "python3-setuptools",
            "python3-wheel", "gcc", "libc6-dev",
            # debootstrap does not resolve virtual packages (python3-ply-lex-3.10)
            "python3-ply"]
STAMP = ".tramprof-root.json"


@dataclass(frozen=True)
class RootSpec:
    name: str
    suite: str
    python: str  # interpreter inside the root, e.g. "python3.13"
    extra: tuple[str, ...] = ()   # added to debootstrap --include
    later: tuple[str, ...] = ()   # apt-get installed afterwards (also into existing roots)


# Debian suites and the CPython they ship. forky/sid carry 3.13 as default plus
# newer versions as extra packages when they exist; those are added per spec.
ROOTS: dict[str, RootSpec] = {
    "bullseye": RootSpec("bullseye", "bullseye", "python3.9",
                         later=("libpython3.9-testsuite",)),
    "trixie": RootSpec("trixie", "trixie", "python3.13", later=("libpython3.13-testsuite",)),
    "sid": RootSpec("sid", "sid", "python3.14", ("python3.14", "python3.14-dev"),
                    later=("libpython3.14-testsuite",)),
    # Debian ships no python3-cffi build for a non-default 3.15: cffi is
    # pip-installed (built against libffi-dev) by the tests.
    "sid315": RootSpec("sid315", "sid", "python3.15",
                       ("python3.15", "python3.15-dev", "libffi-dev", "pkg-config"),
                       later=("libpython3.15-testsuite",)),
}


def mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 or one-line sources)."""
    candidates = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            words = line.split()
            urls = []
            if line.startswith("URIs:"):
                urls = words[1:]
            elif words[:1] == ["deb"]:
                urls = [w for w in words[1:] if "://" in w]
            for url in urls:
                if url.rstrip("/").endswith("/debian"):
                    return url
    return "http://deb.debian.org/debian"


def root_path(name: str) -> Path:
    return CACHE / name


def is_ready(name: str) -> bool:
    return (root_path(name) / STAMP).is_file()


def _missing(name: str, packages: tuple[str, ...]) -> list[str]:
    status = root_path(name) / "var/lib/dpkg/status"
    text = status.read_text(errors="replace") if status.exists() else ""
    installed = set()
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if fields.get("Status") == "install ok installed":
            installed.add(fields.get("Package"))
    return [p for p in packages if p not in installed]


def _install_later(name: str, log=None) -> None:
    """apt-get install the spec's later packages that are missing (under the lock)."""
    missing = _missing(name, ROOTS[name].later)
    if not missing:
        return
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        missing = _missing(name, ROOTS[name].later)
        if not missing:
            return
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        update = run_in_root(name, ["apt-get", "update", "-q"], env=env, timeout=900)
        proc = run_in_root(name, ["apt-get", "install", "-y", "-q", *missing], env=env,
                           timeout=1800)
        if log is not None:
            log.write(update.stdout + proc.stdout)
        if proc.returncode != 0:
            raise RuntimeError(f"apt-get install {missing} in {name} failed:\n"
                               f"{update.stderr[-1500:]}{proc.stderr[-1500:]}")


def ensure_root(name: str, log=None) -> Path:
    """Return the path of root *name*, debootstrapping it first if needed."""
    path = _ensure_base(name, log)
    _install_later(name, log)
    return path


def _ensure_base(name: str, log=None) -> Path:
    spec = ROOTS[name]
    path = root_path(name)
    if is_ready(name):
        return path
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(name):
            return path
        partial = CACHE / f"{name}.partial"
        if partial.exists():
            shutil.rmtree(partial)
        if shutil.which("debootstrap") is None:
            raise RuntimeError("debootstrap is not installed (apt-get install -y debootstrap)")
        started = time.monotonic()
        packages = ",".join([*PACKAGES, *spec.extra])
        proc = subprocess.run(
            ["debootstrap", "--variant=minbase", f"--include={packages}", spec.suite,
             str(partial), mirror()],
            stdout=log or subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            tail = (proc.stdout or "")[-3000:]
            raise RuntimeError(f"debootstrap {spec.suite} failed ({proc.returncode}):\n{tail}")
        elapsed = time.monotonic() - started
        (partial / STAMP).write_text(json.dumps(
            {"suite": spec.suite, "python": spec.python, "seconds": round(elapsed, 1),
             "created": time.time(), "mirror": mirror()}))
        if path.exists():
            shutil.rmtree(path)
        partial.rename(path)
        return path


def creation_seconds(name: str) -> float | None:
    try:
        return float(json.loads((root_path(name) / STAMP).read_text())["seconds"])
    except (OSError, ValueError, KeyError):
        return None


def root_command(name: str, argv: list[str], *, cwd: str = "/") -> list[str]:
    """Host argv that runs *argv* chrooted in root *name*, with /proc and /dev
    mounted in a private mount namespace. Every step execs, so the pid of the
    host process is the pid of the command."""
    path = root_path(name)
    if not is_ready(name):
        raise RuntimeError(f"root {name} does not exist; call ensure_root first")
    script = (
        'set -e; r="$1"; shift; cd_to="$1"; shift; '
        'mount -t proc proc "$r/proc"; mount --rbind /dev "$r/dev"; '
        'exec /usr/sbin/chroot "$r" /bin/sh -c \'cd "$0" && exec "$@"\' "$cd_to" "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh",
            str(path), cwd, *argv]


def run_in_root(name: str, argv: list[str], *, env: dict[str, str] | None = None,
                cwd: str = "/", timeout: float | None = None, input: str | None = None,
                ) -> subprocess.CompletedProcess[str]:
    """Run *argv* chrooted in root *name* (see root_command)."""
    full_env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG": "C.UTF-8", "HOME": "/root"}
    full_env.update(env or {})
    return subprocess.run(root_command(name, argv, cwd=cwd), env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "create":
        for name in argv[1:]:
            started = time.monotonic()
            where = ensure_root(name, log=sys.stdout)
            print(f"{name}: {where} ready ({time.monotonic() - started:.0f} s this call, "
                  f"{creation_seconds(name)} s to create)")
        return 0
    if len(argv) >= 3 and argv[0] == "run":
        proc = run_in_root(argv[1], argv[2:])
        sys.stdout.write(proc.stdout)
        sys.stderr.write(proc.stderr)
        return proc.returncode
    print("usage: roots.py create NAME... | run NAME CMD...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
