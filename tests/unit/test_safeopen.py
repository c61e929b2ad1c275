"""open_untrusted: every hostile kind of file is refused with a stable reason."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tramprof.symbols import safeopen
from tramprof.symbols.safeopen import (
    REFUSAL_REASONS,
    Refusal,
    SafeFile,
    open_untrusted,
)

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (chown/mknod)")
CAP = 1 << 20


def refused(result: SafeFile | Refusal) -> str:
    assert isinstance(result, Refusal), f"expected a refusal, got {result!r}"
    assert result.reason in REFUSAL_REASONS
    return result.reason


@pytest.fixture
def mapfile(tmp_path: Path) -> Path:
    path = tmp_path / "perf-1.map"
    path.write_bytes(b"7f00 10 py::f:/a.py\n")
    return path


def test_reason_names_are_stable() -> None:
    # These strings are metric label values: changing one breaks dashboards.
    assert REFUSAL_REASONS == (
        "missing",
        "symlink",
        "not_regular",
        "hardlink",
        "foreign_owner",
        "permission",
        "io_error",
        "stale",
    )


def test_regular_file_opens_with_identity(mapfile: Path) -> None:
    with open_untrusted(str(mapfile), os.geteuid(), CAP) as f:
        assert isinstance(f, SafeFile)
        st = os.stat(mapfile)
        assert (f.identity.dev, f.identity.ino, f.identity.size) == (
            st.st_dev,
            st.st_ino,
            st.st_size,
        )
        assert f.read_at(0, 100) == mapfile.read_bytes()
        assert f.capped_bytes == 0


def test_descriptor_is_close_on_exec(mapfile: Path) -> None:
    f = open_untrusted(str(mapfile), None, CAP)
    assert isinstance(f, SafeFile)
    try:
        assert not os.get_inheritable(f._fd)
    finally:
        f.close()
    f.close()  # idempotent


def test_missing(tmp_path: Path) -> None:
    assert refused(open_untrusted(str(tmp_path / "nope.map"), None, CAP)) == "missing"


def test_symlink_to_real_map_is_refused(tmp_path: Path, mapfile: Path) -> None:
    link = tmp_path / "perf-2.map"
    link.symlink_to(mapfile)
    assert refused(open_untrusted(str(link), None, CAP)) == "symlink"


def test_dangling_symlink_is_refused(tmp_path: Path) -> None:
    link = tmp_path / "perf-3.map"
    link.symlink_to(tmp_path / "does-not-exist")
    assert refused(open_untrusted(str(link), None, CAP)) == "symlink"


def test_fifo_without_writer_is_refused_immediately(tmp_path: Path) -> None:
    fifo = tmp_path / "perf-4.map"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert refused(open_untrusted(str(fifo), None, CAP)) == "not_regular"
    assert time.monotonic() - t0 < 1.0


def _run_bounded(fn: object, timeout: float) -> list[object]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)  # type: ignore[operator]
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "open_untrusted blocked"
    return out


def test_fifo_swapped_in_after_the_stat_still_does_not_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pre-open stat is only a courtesy: if a FIFO replaces the file
    between stat and open, O_NONBLOCK keeps the open from hanging and the
    fstat of the descriptor refuses it."""
    regular = tmp_path / "regular"
    regular.write_bytes(b"x")
    fifo = tmp_path / "perf-5.map"
    os.mkfifo(fifo)
    real_stat = os.stat

    def lying_stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if path == str(fifo):
            return real_stat(regular)
        return real_stat(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(safeopen.os, "stat", lying_stat)
    try:
        out = _run_bounded(lambda: open_untrusted(str(fifo), None, CAP), 2.0)
    finally:
        # Unblock a hung reader, should the test fail.
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
    assert refused(out[0]) == "not_regular"  # type: ignore[arg-type]


def test_directory_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "perf-6.map"
    d.mkdir()
    assert refused(open_untrusted(str(d), None, CAP)) == "not_regular"


def test_unix_socket_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "perf-7.map"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))
        assert refused(open_untrusted(str(path), None, CAP)) == "not_regular"


@pytest.mark.parametrize("device", ["/dev/null", "/dev/zero"])
def test_system_char_devices_are_refused(device: str) -> None:
    t0 = time.monotonic()
    assert refused(open_untrusted(device, None, CAP)) == "not_regular"
    assert time.monotonic() - t0 < 1.0


@needs_root
def test_char_device_planted_in_tmp_is_refused(tmp_path: Path) -> None:
    dev = tmp_path / "perf-8.map"
    os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # same as /dev/zero
    assert refused(open_untrusted(str(dev), None, CAP)) == "not_regular"


@needs_root
def test_foreign_owner_is_refused(mapfile: Path) -> None:
    os.chown(mapfile, 12345, 12345)
    assert refused(open_untrusted(str(mapfile), 1000, CAP)) == "foreign_owner"
    # The owner itself, or no expectation at all, is accepted.
    for uid in (12345, None):
        f = open_untrusted(str(mapfile), uid, CAP)
        assert isinstance(f, SafeFile)
        f.close()


@needs_root
def test_root_owned_file_is_accepted_for_any_uid(mapfile: Path) -> None:
    os.chown(mapfile, 0, 0)
    f = open_untrusted(str(mapfile), 12345, CAP)
    assert isinstance(f, SafeFile)
    f.close()


def test_hardlinked_file_is_refused(tmp_path: Path, mapfile: Path) -> None:
    other = tmp_path / "perf-9.map"
    os.link(mapfile, other)
    assert refused(open_untrusted(str(other), None, CAP)) == "hardlink"


@needs_root
def test_permission_denied(tmp_path: Path, mapfile: Path) -> None:
    """An unprivileged caller that cannot read the file gets "permission"."""
    tmp_path.chmod(0o755)
    mapfile.chmod(0o600)
    code = (
        "from tramprof.symbols.safeopen import open_untrusted;"
        f"r = open_untrusted({str(mapfile)!r}, None, 100);"
        "print(getattr(r, 'reason', 'opened'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        user=65534,
        capture_output=True,
        text=True,
        timeout=30,
        cwd="/",
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot run the interpreter as nobody: {proc.stderr.strip()[-200:]}")
    assert proc.stdout.strip() == "permission"


def test_reads_are_capped(tmp_path: Path) -> None:
    path = tmp_path / "big.map"
    with open(path, "wb") as fh:
        fh.truncate(8 << 30)  # sparse: 8 GiB on paper, nothing on disk
    with open_untrusted(str(path), None, 4096) as f:
        assert isinstance(f, SafeFile)
        assert f.limit == 4096
        assert f.capped_bytes == (8 << 30) - 4096
        assert len(f.read_at(0, 1 << 20)) == 4096
        assert f.read_at(4096, 10) == b""
        assert f.read_at(4000, 1000) == b"\0" * 96


# -- resolution below a process root ---------------------------------------


@pytest.fixture
def fake_root(tmp_path: Path) -> Iterator[Path]:
    root = tmp_path / "proc" / "42" / "root"
    (root / "tmp").mkdir(parents=True)
    (root / "tmp" / "perf-7.map").write_bytes(b"1000 10 x\n")
    yield root


def test_open_below_root(fake_root: Path) -> None:
    f = open_untrusted("tmp/perf-7.map", None, CAP, root=str(fake_root))
    assert isinstance(f, SafeFile)
    with f:
        assert f.read_at(0, 100) == b"1000 10 x\n"


def test_symlinked_directory_below_root_is_refused(fake_root: Path, tmp_path: Path) -> None:
    """A container pointing its /tmp somewhere else (an absolute symlink
    would otherwise resolve against the host's root) is refused."""
    elsewhere = tmp_path / "host-etc"
    elsewhere.mkdir()
    (elsewhere / "perf-7.map").write_bytes(b"2000 10 y\n")
    (fake_root / "tmp" / "perf-7.map").unlink()
    (fake_root / "tmp").rmdir()
    (fake_root / "tmp").symlink_to(elsewhere)
    result = open_untrusted("tmp/perf-7.map", None, CAP, root=str(fake_root))
    assert refused(result) == "symlink"
    # Without the root walk the same path would have been followed:
    plain = open_untrusted(str(fake_root / "tmp" / "perf-7.map"), None, CAP)
    assert isinstance(plain, SafeFile)
    plain.close()


def test_file_instead_of_directory_below_root(fake_root: Path) -> None:
    assert refused(open_untrusted("tmp/perf-7.map/x", None, CAP, root=str(fake_root))) == (
        "not_regular"
    )


def test_missing_root(tmp_path: Path) -> None:
    result = open_untrusted("tmp/perf-7.map", None, CAP, root=str(tmp_path / "proc/9/root"))
    assert refused(result) == "missing"


@pytest.mark.parametrize("bad", ["../etc/shadow", "tmp/../../x", "", "/"])
def test_escaping_relative_paths_are_rejected(fake_root: Path, bad: str) -> None:
    with pytest.raises(ValueError):
        open_untrusted(bad, None, CAP, root=str(fake_root))


def test_no_descriptor_leaks(fake_root: Path, tmp_path: Path) -> None:
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(50):
        open_untrusted("tmp/perf-7.map", None, CAP, root=str(fake_root)).close()  # type: ignore[union-attr]
        open_untrusted("tmp/nope.map", None, CAP, root=str(fake_root))
        open_untrusted("nope/perf-7.map", None, CAP, root=str(fake_root))
        open_untrusted(str(tmp_path), None, CAP)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_mapped_object_link_to_something_not_regular_is_never_opened(tmp_path: Path) -> None:
    """A link followed to the mapped object (``/proc/PID/map_files/...``) is
    checked by ``stat`` through it before any open: opening a device can
    have side effects. Seen here with a FIFO, whose open for reading would
    release a writer waiting in its own open."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "map_files-link"
    link.symlink_to(fifo)
    writer_opened = threading.Event()

    def writer() -> None:
        fd = os.open(fifo, os.O_WRONLY)  # blocks until a reader opens it
        writer_opened.set()
        os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    time.sleep(0.2)  # the writer waits in its open by now
    try:
        result = safeopen.open_mapped_object(str(link))
        assert refused(result) == "not_regular"  # type: ignore[arg-type]
        assert not writer_opened.wait(0.3), "the FIFO was opened"
    finally:
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # release the writer
        thread.join(2)
        os.close(fd)
