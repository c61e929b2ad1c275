"""The runtime's own files (/tmp/perf-<pid>.map, /tmp/jit-<pid>.dump) when
another local user got to the path first, and names that try to forge lines.

The target (scripts/files_target.py) prints its pid and waits; the test
plants something at the path, then lets it activate. A path that is not a
stale file of our own is left untouched: a warning names it, the runtime
stays active without that file, and activation never blocks."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tramprof.unwind import descriptor as desc

from .conftest import PERF_LINE, Interp, read_perf_map
from .test_jitdump import parse_jitdump

pytestmark = pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 only")

FOREIGN_UID = 65534          # nobody: "another local user"
TIMEOUT = 60.0               # a hung activation fails the test instead of hanging it
LINE = re.compile(rb"^([0-9a-f]+) ([0-9a-f]+) (py::[^\n]+)$")


def escape(text: str) -> str:
    """The runtime's escaping (ABI.md section 5), for expected names."""
    out = []
    for ch in text:
        o = ord(ch)
        if ch in "\n\r\t":
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}[ch])
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\x{o:02x}")
        elif 0x80 <= o <= 0x9F or o in (0x2028, 0x2029):
            out.append(f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


@dataclass
class Run:
    pid: int
    report: dict
    stderr: str
    stub_count: int             # from the descriptor, read while the target waits
    map_bytes: bytes | None     # the perf map as it was at that moment


def run_target(interp: Interp, started: list, plant: Callable[[int], None], *,
               jitdump: bool = False, fork: bool = False) -> Run:
    env = {"TRAMPROF_TRAMPOLINES_JITDUMP": "1"} if jitdump else {}
    proc = interp.popen(interp.script("files_target.py"), *(["fork"] if fork else []), env=env)
    started.append(proc)
    watchdog = threading.Timer(TIMEOUT, proc.kill)
    watchdog.start()
    try:
        first = proc.stdout.readline()
        assert first, proc.stderr.read()
        pid = json.loads(first)["pid"]
        plant(pid)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"target died or hung (activation blocked?)\n{proc.stderr.read()}"
        report = json.loads(line)
        stub_count = desc.read_descriptor(pid).stub_count
        map_path = interp.perf_map(pid)
        map_bytes = map_path.read_bytes() if report["map"] else None
        proc.stdin.close()
        status = proc.wait(timeout=TIMEOUT)
    finally:
        watchdog.cancel()
    stderr = proc.stderr.read()
    assert status == 0, stderr
    return Run(pid, report, stderr, stub_count, map_bytes)


def check_map(run: Run, interp: Interp) -> list[tuple[int, int, str]]:
    """The map holds exactly one well-formed line per stub of this process."""
    assert run.map_bytes is not None
    raw = run.map_bytes.split(b"\n")
    assert raw[-1] == b""
    for line in raw[:-1]:
        assert LINE.match(line), line
    entries = []
    for line in run.map_bytes.decode().splitlines():  # str.splitlines() agrees too
        match = PERF_LINE.match(line)
        assert match, line
        entries.append((int(match.group(1), 16), int(match.group(2), 16), match.group(3)))
    assert len(entries) == len(raw) - 1 == run.stub_count
    names = {name: address for address, _size, name in entries}
    assert names[f"py::plain:{interp.script('files_target.py')}"] == run.report["plain"]
    return entries


def warnings_in(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.startswith("tramprof_trampolines: ")]


def clear_leftover(path: Path) -> None:
    """An earlier process with this pid (pids wrap at 32768 on a small
    machine) may have left its file at ``path``: not the plant under test."""
    if path.is_symlink() or path.is_file():
        path.unlink()


@pytest.fixture
def planted() -> Iterator[list[Path]]:
    """Paths the test planted, removed at the end whatever they are."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass


# ---------------------------------------------------------------------------
# Something that is not ours at the perf map path
# ---------------------------------------------------------------------------

@dataclass
class Plant:
    """What to put at the path, the reason the warning must give, and a check
    that it was left alone."""

    reason: str
    make: Callable[[Path, Path], dict]          # (path, scratch) -> state
    untouched: Callable[[Path, Path, dict], None]


def _fifo(reader: bool) -> Plant:
    def make(path: Path, scratch: Path) -> dict:
        os.mkfifo(path, 0o666)
        state = {}
        if reader:
            # An attacker holding the read end: the old open(O_WRONLY)
            # succeeded and the process wrote its function names into it.
            state["fd"] = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        return state

    def untouched(path: Path, scratch: Path, state: dict) -> None:
        assert stat.S_ISFIFO(path.lstat().st_mode)
        if reader:
            try:
                data = os.read(state["fd"], 65536)
            except BlockingIOError:
                data = b""
            finally:
                os.close(state["fd"])
            assert data == b""

    return Plant("FIFO", make, untouched)


def _foreign_file() -> Plant:
    content = b"attacker-owned file\n"

    def make(path: Path, scratch: Path) -> dict:
        path.write_bytes(content)
        os.chown(path, FOREIGN_UID, FOREIGN_UID)
        os.chmod(path, 0o666)
        return {"ino": path.lstat().st_ino}

    def untouched(path: Path, scratch: Path, state: dict) -> None:
        info = path.lstat()
        assert stat.S_ISREG(info.st_mode)
        assert (info.st_uid, info.st_ino, stat.S_IMODE(info.st_mode)) == \
            (FOREIGN_UID, state["ino"], 0o666)
        assert path.read_bytes() == content

    return Plant(f"owned by uid {FOREIGN_UID}", make, untouched)


def _symlink(dangling: bool) -> Plant:
    content = b"victim file\n"

    def make(path: Path, scratch: Path) -> dict:
        target = scratch / ("absent" if dangling else "victim")
        if not dangling:
            target.write_bytes(content)
            os.chmod(target, 0o644)
        path.symlink_to(target)
        return {"target": target}

    def untouched(path: Path, scratch: Path, state: dict) -> None:
        assert path.is_symlink()
        target = state["target"]
        if dangling:
            assert not target.exists()
        else:
            assert target.read_bytes() == content
            assert stat.S_IMODE(target.stat().st_mode) == 0o644

    return Plant("symbolic link", make, untouched)


def _hardlink() -> Plant:
    content = b"somebody's file, linked into /tmp\n"

    def make(path: Path, scratch: Path) -> dict:
        original = scratch / "linked"
        original.write_bytes(content)
        try:
            os.link(original, path)
        except OSError as exc:
            if exc.errno == errno.EXDEV:
                pytest.skip("/tmp and the work dir are on different file systems")
            raise
        return {"original": original}

    def untouched(path: Path, scratch: Path, state: dict) -> None:
        assert path.read_bytes() == content
        assert path.lstat().st_nlink == 2

    return Plant("2 hard links", make, untouched)


def _directory() -> Plant:
    def make(path: Path, scratch: Path) -> dict:
        path.mkdir(mode=0o777)
        return {}

    def untouched(path: Path, scratch: Path, state: dict) -> None:
        assert path.is_dir() and not any(path.iterdir())

    return Plant("directory", make, untouched)


PLANTS = {
    "fifo": _fifo(reader=False),
    "fifo-with-reader": _fifo(reader=True),
    "foreign-file": _foreign_file(),
    "symlink": _symlink(dangling=False),
    "dangling-symlink": _symlink(dangling=True),
    "hardlink": _hardlink(),
    "directory": _directory(),
}


@pytest.fixture
def scratch(interp: Interp) -> Iterator[Path]:
    """A directory on the interpreter's file system (for link targets)."""
    path = interp.host_path(interp.workdir) / f"scratch-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("kind", list(PLANTS))
def test_perf_map_path_taken(interp: Interp, started: list, planted: list, scratch: Path,
                             kind: str) -> None:
    """Nothing at the path is opened, followed, written or truncated; the
    runtime stays active without a map; one warning names path and reason."""
    plant = PLANTS[kind]
    state: dict = {}

    def do_plant(pid: int) -> None:
        path = interp.perf_map(pid)
        planted.append(path)
        clear_leftover(path)
        state.update(plant.make(path, scratch))

    run = run_target(interp, started, do_plant)
    assert run.report["activate_seconds"] < 5
    assert run.report["active"] is True
    assert run.report["map"] is None
    assert run.report["plain"] and run.report["hostile"]  # stubs without a map
    plant.untouched(interp.perf_map(run.pid), scratch, state)
    warnings = warnings_in(run.stderr)
    assert len(warnings) == 1, run.stderr
    assert f"/tmp/perf-{run.pid}.map" in warnings[0]
    assert plant.reason in warnings[0]


def test_stale_own_file_replaced(interp: Interp, started: list, planted: list) -> None:
    """A regular file of our own euid (an earlier process with this pid) is
    replaced, not appended to: the map holds only this process's lines."""

    def do_plant(pid: int) -> None:
        path = interp.perf_map(pid)
        planted.append(path)
        path.write_bytes(b"deadbeef 10 py::stale:/old/process.py\n")
        os.chmod(path, 0o644)

    run = run_target(interp, started, do_plant)
    assert run.report["map"] == f"/tmp/perf-{run.pid}.map"
    assert warnings_in(run.stderr) == []
    assert b"stale" not in run.map_bytes
    check_map(run, interp)
    info = interp.perf_map(run.pid).lstat()
    assert stat.S_ISREG(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid()


def test_hostile_names_escaped(interp: Interp, started: list, planted: list) -> None:
    """A qualname / co_filename with newlines, CR, ESC, NUL, C1 and U+2028
    gives one visible-escaped line; no forged entry appears. The jitdump's
    CODE_LOAD names are the same escaped strings."""
    run = run_target(interp, started, lambda pid: planted.extend(
        [interp.perf_map(pid), interp.host_path(f"/tmp/jit-{pid}.dump")]), jitdump=True)
    entries = check_map(run, interp)
    names = {name: address for address, _size, name in entries}
    expected = f"py::{escape(run.report['hostile_name'])}:{escape(run.report['hostile_file'])}"
    assert names[expected] == run.report["hostile"]
    assert expected.startswith("py::evil\\n7f0000000000 42 py::forged:/etc/passwd\\r\\t\\x1b[2J"
                               "\\x00\\x7f\\u0085\\u2028end:/tmp/x\\ny\\x1b]0;title\\x07.py")
    assert not any(n.startswith("py::forged") for n in names)
    assert 0x7F0000000000 not in {a for a, _s, _n in entries}
    for _address, _size, name in entries:
        assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in name), name
    # jitdump: one CODE_LOAD per stub, same names, no NUL or newline inside.
    assert run.report["jitdump"] == f"/tmp/jit-{run.pid}.dump"
    _header, records = parse_jitdump(interp.host_path(run.report["jitdump"]))
    loads = [r for k, r in records if k == 0]
    final = read_perf_map(interp.perf_map(run.pid))  # both files, after the exit
    assert [(r["addr"], r["name"]) for r in loads] == [(a, n) for a, _s, n in final]
    assert expected in {r["name"] for r in loads}


def test_jitdump_fifo(interp: Interp, started: list, planted: list) -> None:
    """A FIFO (with a reader) at /tmp/jit-<pid>.dump: activation does not
    block, nothing is written to it, the perf map is still written."""
    plant = _fifo(reader=True)
    state: dict = {}

    def do_plant(pid: int) -> None:
        path = interp.host_path(f"/tmp/jit-{pid}.dump")
        planted.extend([path, interp.perf_map(pid)])
        clear_leftover(path)
        state.update(plant.make(path, Path("/")))

    run = run_target(interp, started, do_plant, jitdump=True)
    assert run.report["activate_seconds"] < 5
    assert run.report["active"] is True
    assert run.report["jitdump"] is None
    assert run.report["map"] == f"/tmp/perf-{run.pid}.map"
    check_map(run, interp)
    plant.untouched(interp.host_path(f"/tmp/jit-{run.pid}.dump"), Path("/"), state)
    warnings = warnings_in(run.stderr)
    assert len(warnings) == 1, run.stderr
    assert f"/tmp/jit-{run.pid}.dump" in warnings[0] and "FIFO" in warnings[0]


def test_jitdump_stale_own_file_replaced(interp: Interp, started: list, planted: list) -> None:
    """An old jitdump of our own is replaced by a fresh, valid one (0600)."""

    def do_plant(pid: int) -> None:
        path = interp.host_path(f"/tmp/jit-{pid}.dump")
        planted.extend([path, interp.perf_map(pid)])
        path.write_bytes(b"\xff" * 4096)

    run = run_target(interp, started, do_plant, jitdump=True)
    assert warnings_in(run.stderr) == []
    path = interp.host_path(f"/tmp/jit-{run.pid}.dump")
    assert stat.S_IMODE(path.lstat().st_mode) == 0o600
    header, records = parse_jitdump(path)
    assert header["pid"] == run.pid
    loads = [r for k, r in records if k == 0]
    assert run.report["plain"] in {r["addr"] for r in loads}


def test_fork_child_writes_map_when_parent_could_not(interp: Interp, started: list,
                                                     planted: list) -> None:
    """The parent's map path is a FIFO; its fork child (another pid) still
    creates its own map with every inherited stub."""

    def do_plant(pid: int) -> None:
        path = interp.perf_map(pid)
        planted.append(path)
        clear_leftover(path)
        os.mkfifo(path, 0o666)

    run = run_target(interp, started, do_plant, fork=True)
    child = run.report["child"]
    assert run.report["map"] is None
    assert run.report["child_status"] == 0
    assert child["active"] is True
    assert child["map"] == f"/tmp/perf-{child['pid']}.map"
    child_map = interp.perf_map(child["pid"])
    planted.append(child_map)
    names = {n: a for a, _s, n in read_perf_map(child_map)}
    assert names[f"py::plain:{interp.script('files_target.py')}"] == run.report["plain"]
    assert len(warnings_in(run.stderr)) == 1, run.stderr

