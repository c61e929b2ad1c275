"""The real `go tool pprof` against a real daemon's /debug/pprof/profile?seconds=N
(root): Go's semantics (the next N seconds, then the answer), exact chains in
-traces and -top, DWARF lines found again through the profile's mappings
(-symbolize=local:force), and -list of a Python function reading the source
file the profile names."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tramprof.symbols.elf import read_build_id

from tests.conftest import REPO, requires_root
from tests.e2e.test_daemon import Daemon, daemon, value  # noqa: F401  (fixture)
from tests.trampolines.conftest import Interp, _cleanup, host_interp  # noqa: F401  (fixtures)

GO = shutil.which("go") or next((p for p in ("/usr/lib/go/bin/go",) if os.path.exists(p)),
                                None)
pytestmark = [requires_root,
              pytest.mark.skipif(GO is None, reason="go is not installed (Debian: golang-go)")]

SECONDS = 3
# go tool pprof gives up on the fetch after 1.5 x seconds (and then fails):
# a report at all means the answer came within that.
PPROF_TIMEOUT = 1.5 * SECONDS
# Samples that may sit outside the expected chain: timer interrupts in the
# middle of the entry code, the first instructions of a function.
SHARE = 0.95


@dataclass
class Trace:
    seconds: float
    frames: list[str]  # leaf first, as -traces prints them
    labels: dict[str, str]


@dataclass
class Report:
    header: dict[str, str]
    body: list[str]
    saved: Path | None


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0,
          "mins": 60.0, "hrs": 3600.0}


def seconds_of(text: str) -> float:
    match = re.fullmatch(r"([0-9.]+)([a-zµ]*)", text)
    assert match, text
    return float(match[1]) * _UNITS[match[2]]


class Pprof:
    """`go tool pprof` with its own HOME, caches and saved-profile directory."""

    def __init__(self, tmp: Path) -> None:
        self.env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp / "home"),
                    "GOCACHE": str(tmp / "gocache"), "PPROF_TMPDIR": str(tmp / "saved"),
                    "PPROF_BINARY_PATH": str(tmp / "no-binaries")}

    def __call__(self, *args: str) -> Report:
        assert GO is not None
        done = subprocess.run([GO, "tool", "pprof", *args], capture_output=True, text=True,
                              timeout=120, env=self.env)
        assert done.returncode == 0, done.stderr
        saved = re.search(r"Saved profile in (\S+)", done.stderr)
        header: dict[str, str] = {}
        lines = done.stdout.splitlines()
        while lines and re.match(r"^(File|Build ID|Type|Time|Duration|Showing|Dropped)\b",
                                 lines[0]):
            key, _, value = lines.pop(0).partition(": ")
            header[key] = value
        return Report(header, lines, Path(saved[1]) if saved else None)


def traces(report: Report) -> list[Trace]:
    out: list[Trace] = []
    for block in "\n".join(report.body).split("-----------+" + "-" * 55):
        labels: dict[str, str] = {}
        current: Trace | None = None
        for line in block.splitlines():
            if not line.strip():
                continue
            value = re.match(r"^\s*([0-9.]+[a-zµ]*)\s{3}(\S.*)$", line)
            label = re.match(r"^\s*(\w+):\s{2}(.*)$", line)
            if current is None and label and not value:
                labels[label[1]] = label[2]
            elif current is None and value:
                current = Trace(seconds_of(value[1]), [value[2]], labels)
            elif current is not None:
                current.frames.append(line.strip())
        if current is not None:
            out.append(current)
    assert out, report.body[:20]
    return out


def share(found: list[Trace], good) -> float:  # type: ignore[no-untyped-def]
    total = sum(t.seconds for t in found)
    assert total > 0
    return sum(t.seconds for t in found if good(t)) / total


def duration(report: Report) -> float:
    match = re.match(r"([0-9.]+[a-z]*), Total samples = ", report.header["Duration"])
    assert match, report.header
    return seconds_of(match[1])


@pytest.fixture
def pprof(tmp_path: Path) -> Pprof:
    return Pprof(tmp_path)


def record_url(port: int, seconds: int = SECONDS) -> str:
    return f"http://127.0.0.1:{port}/debug/pprof/profile?seconds={seconds}"


def warm_up(d: Daemon, tables: int = 0, timeout: float = 60) -> None:
    """First recordings: the daemon's first drain reads every binary of the
    target (seconds on a busy machine), which go tool pprof would not wait
    for; with ``tables``, until that many unwind tables are loaded (the
    objects sampled in the first recording are compiled in child processes)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(record_url(d.port, 1), timeout=60) as r:
            assert r.status == 200
        loaded = value(d.metrics(), "tramprof_unwind_table_objects")
        if loaded >= tables:
            return
        assert time.monotonic() < deadline, f"{loaded} of {tables} unwind tables in {timeout} s"


def line_of(path: Path, text: str) -> int:
    lines = path.read_text().splitlines()
    found = [i for i, line in enumerate(lines, 1) if line.strip() == text]
    assert len(found) == 1, (text, found)
    return found[0]


CHAIN = ["chain_c", "chain_b", "chain_a", "main"]


def native_chain(t: Trace) -> bool:
    """chain_c..main, then libc's start-up frames up to _start (libc has no
    frame pointers: its frames come from unwind tables)."""
    if "chain_c" not in t.frames:
        return False
    at = t.frames.index("chain_c")
    above = t.frames[at + len(CHAIN):]
    return (t.frames[at:at + len(CHAIN)] == CHAIN and above[-1:] == ["_start"]
            and all(f == "_start" or f.startswith(("__libc_start", "libc.so.6+0x"))
                    for f in above))


def test_native_chain_through_go_tool_pprof(daemon, targets, start_target,  # noqa: F811
                                            pprof):
    target = start_target(str(targets / "chain"), "120")
    # A drain interval far longer than the recording: both of its ends are
    # drains the recording asks for.
    d = daemon("--interval", "30", "--frequency", "199", "--pid", str(target.pid))
    warm_up(d, tables=1)  # libc's: it has no frame pointers
    began = time.monotonic()
    report = pprof("-traces", record_url(d.port))
    took = time.monotonic() - began
    # The fetch itself is bounded by pprof's own timeout; the wall time also
    # holds go's start and the symbolization after the fetch (0.3 s over the
    # timeout on a loaded machine), so it is held only far below the interval.
    assert SECONDS <= took < PPROF_TIMEOUT + 5
    assert SECONDS <= duration(report) < SECONDS + 0.5
    assert report.header["File"] == "chain"
    with open(targets / "chain", "rb") as f:
        assert report.header["Build ID"] == read_build_id(f)
    found = traces(report)
    assert {(t.labels["pid"], t.labels["comm"], t.labels["process"]) for t in found} == {
        (str(target.pid), "chain", "chain")}
    # User frames at the root end, kernel frames (interrupts) leaf-side of them.
    assert share(found, native_chain) >= SHARE, found[:3]

    assert report.saved is not None
    top = pprof("-top", str(report.saved))
    rows = [line.split() for line in top.body[1:]]
    assert rows[0][-1] == "chain_c"
    cum = {row[-1]: float(row[4].rstrip("%")) for row in rows}
    assert cum["chain_a"] == cum["chain_b"] == cum["main"] == 100.0

    # Lines from the target's DWARF, which the daemon does not read: pprof
    # finds the binary through the profile's mapping and build id.
    source = REPO / "tests" / "targets" / "chain.c"
    forced = traces(pprof("-symbolize=local:force", "-traces", "-lines", str(report.saved)))
    # The while loop: its head down to the braces closing it after rarely(x).
    loop = range(line_of(source, "while (now() < until) {"),
                 line_of(source, "rarely(x);") + 3)

    def lines_exact(t: Trace) -> bool:
        user = next((t.frames[i:] for i, f in enumerate(t.frames) if f.startswith("chain_c ")),
                    [""])
        leaf = re.fullmatch(rf"chain_c {re.escape(str(source))}:(\d+)", user[0])
        return (leaf is not None and int(leaf[1]) in loop
                and user[1] == f"chain_b {source}:{line_of(source, 'chain_c(until);')}"
                and user[2] == f"chain_a {source}:{line_of(source, 'chain_b(until);')}")

    assert share(forced, lines_exact) >= SHARE, forced[:3]


PY_TARGET = '''\
import sys
import time


def spin_leaf(until):
    x = 0
    while time.monotonic() < until:
        for i in range(10000):
            x = (x * 31 + i) & 0xFFFF
    return x


def spin_middle(until):
    return spin_leaf(until)


def spin_outer(until):
    return spin_middle(until)


def run():
    until = time.monotonic() + float(sys.argv[1])
    print("ready", flush=True)
    spin_outer(until)


if __name__ == "__main__":
    run()
'''
PY_CHAIN = ["spin_leaf", "spin_middle", "spin_outer", "run", "<module>"]


@pytest.fixture
def python_target(host_interp: Interp, tmp_path: Path  # noqa: F811
                  ) -> Iterator[tuple[int, Path]]:
    script = tmp_path / "spin_app.py"
    script.write_text(PY_TARGET)
    proc = host_interp.popen(str(script), "120", env={"TRAMPROF_TRAMPOLINES": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", (line, proc.stderr.read() if proc.stderr else "")
        yield proc.pid, script
    finally:
        proc.kill()
        proc.wait()
        Path(f"/tmp/perf-{proc.pid}.map").unlink(missing_ok=True)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 trampoline stubs only")
def test_python_chain_and_source_through_go_tool_pprof(daemon, python_target,  # noqa: F811
                                                       pprof):
    pid, script = python_target
    d = daemon("--interval", "30", "--frequency", "199", "--pid", str(pid))
    warm_up(d)
    report = pprof("-traces", "-lines", record_url(d.port))
    assert SECONDS <= duration(report) < SECONDS + 0.5
    python = os.path.realpath("/usr/bin/python3")
    assert report.header["File"] == os.path.basename(python)
    with open(python, "rb") as f:
        assert report.header["Build ID"] == read_build_id(f)
    found = traces(report)
    comm = Path(f"/proc/{pid}/comm").read_text().strip()
    assert {(t.labels["pid"], t.labels["comm"]) for t in found} == {(str(pid), comm)}
    suffix = f" {script}"

    def python_frames(t: Trace) -> list[str]:
        return [f.removesuffix(suffix) for f in t.frames if f.endswith(suffix)]

    # Exactly the script's chain, leaf first, in every sample but a few.
    assert share(found, lambda t: python_frames(t) == PY_CHAIN) >= SHARE, found[:3]

    # -list reads the source file where the profile says it is. Perf map
    # names carry no line, so the samples sit on line 0 (not shown) and
    # pprof lists the file's first lines; the totals are the function's.
    assert report.saved is not None
    listing = pprof("-list", "^spin_leaf$", str(report.saved)).body
    assert listing[1] == f"ROUTINE ======================== spin_leaf in {script}"
    flat, cum = listing[2].split()[:2]
    top = {row.split()[-1]: row.split() for row in pprof("-top", str(report.saved)).body[1:]}
    # The same total, printed as -top prints it or in another unit (3.01s, 3005.02ms).
    assert flat == "0" and seconds_of(cum) == pytest.approx(seconds_of(top["spin_leaf"][3]),
                                                             rel=0.01)
    assert float(top["spin_leaf"][4].rstrip("%")) >= 100 * SHARE
    source = script.read_text().splitlines()
    shown = [re.match(r"^\s+\.\s+\.\s+(\d+):(.*)$", line) for line in listing[3:]]
    assert shown and all(shown), listing
    assert [(int(m[1]), m[2]) for m in shown if m] == [(i, source[i - 1])
                                                        for i in range(1, len(shown) + 1)]
