"""Helpers shared by the benchmarks: build the workload, run the daemon,
name the frames of sleeping processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tramprof.procfs.identity import read_stat
from tramprof.symbols.images import ProcessImage, ProcessRegistry

HERE = Path(__file__).resolve().parent
TRAMPROF = str(Path(sys.executable).parent / "tramprof")


def build_workload() -> str:
    out = Path(tempfile.mkdtemp(prefix="tramprof-bench-")) / "work"
    subprocess.run(["gcc", "-O2", "-fno-omit-frame-pointer", "-o", str(out),
                    str(HERE / "work.c")], check=True)
    return str(out)


def install_trampolines() -> dict[str, str]:
    """Build the trampoline runtime for the system Python into a private user
    base; returns the environment that activates it at interpreter start."""
    base = Path(tempfile.mkdtemp(prefix="tramprof-bench-userbase-"))
    env = {**os.environ, "PYTHONUSERBASE": str(base), "PIP_BREAK_SYSTEM_PACKAGES": "1",
           "PIP_ROOT_USER_ACTION": "ignore"}
    try:
        subprocess.run(["/usr/bin/python3", "-m", "pip", "install", "-q", "--user",
                        "--no-build-isolation", "--no-deps", "--disable-pip-version-check",
                        str(HERE.parent / "trampolines")], check=True, env=env,
                       cwd=str(base))
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(base, ignore_errors=True)
        raise SystemExit("building the trampoline runtime for /usr/bin/python3 failed (pip's "
                         "output above; it needs cffi and the Python headers, which `make "
                         "bench` installs with the test packages)") from exc
    return {**env, "TRAMPROF_TRAMPOLINES": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Daemon:
    """`tramprof run` in the background, ready once /healthz answers."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [TRAMPROF, "run", "--listen", f"127.0.0.1:{self.port}", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.get("/healthz")
                return
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.proc.kill()  # never leave one running: it would load what follows
                    self.proc.wait()
                    raise RuntimeError("daemon did not start") from None
                time.sleep(0.1)

    def get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return str(r.read().decode())

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def rss_mib(self) -> tuple[float, float]:
        """(VmRSS, RssAnon) in MiB."""
        fields = dict(line.split(":", 1) for line in
                      Path(f"/proc/{self.proc.pid}/status").read_text().splitlines()
                      if ":" in line)
        return (int(fields["VmRSS"].split()[0]) / 1024,
                int(fields["RssAnon"].split()[0]) / 1024)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=30)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` (0..1) of ``values``, nearest rank; NaN for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


@contextmanager
def sleepers(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` processes of ``/usr/bin/python3``, loaded and asleep; killed
    at the end."""
    procs = [subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(3600)"])
             for _ in range(count)]
    try:
        time.sleep(0.5)  # loaded and asleep
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def new_image(registry: ProcessRegistry, pid: int) -> ProcessImage:
    """The process image of ``pid`` as the daemon builds it when first sampled."""
    ticks = read_stat(pid).start_ticks
    image = registry.warm(pid, ticks * (1_000_000_000 // os.sysconf("SC_CLK_TCK")), 1)
    assert image is not None and image.symbolizer is not None
    return image


def has_function_name(name: str) -> bool:
    """A frame's name is a function's, not a fallback (file+offset, a marker):
    only those are shared between processes."""
    return "+0x" not in name and not name.startswith("[")
