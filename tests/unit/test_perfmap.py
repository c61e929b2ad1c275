"""perf map parsing, incremental reading, hostile files and a real writer (node)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from tramprof.symbols.perfmap import PerfMap, parse_lines, perf_map_path

IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not IS_ROOT, reason="needs root (chown/mknod)")
UID = os.geteuid()


def write(path: Path, data: bytes) -> None:
    path.write_bytes(data)


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


@pytest.fixture
def mapfile(tmp_path: Path) -> Path:
    return tmp_path / "perf-1234.map"


# -- line format -----------------------------------------------------------


def test_cpython_lines_with_spaces_in_names() -> None:
    block = (
        b"7f0000001000 10 py::foo:/a b.py\n"
        b"7f0000001010 10 py::<module>:<frozen importlib._bootstrap>\n"
    )
    p = parse_lines(block)
    assert list(p.starts) == [0x7F0000001000, 0x7F0000001010]
    assert list(p.ends) == [0x7F0000001010, 0x7F0000001020]
    assert p.names == ["py::foo:/a b.py", "py::<module>:<frozen importlib._bootstrap>"]
    assert (p.malformed, p.long_lines) == (0, 0)


@pytest.mark.parametrize(
    ("line", "start", "size", "name"),
    [
        (b"7f00 10 lower", 0x7F00, 0x10, "lower"),
        (b"7F00 1A UPPER", 0x7F00, 0x1A, "UPPER"),
        (b"0x7f00 0x10 jdk25", 0x7F00, 0x10, "jdk25"),
        (b"0X7F00 0X10 both upper", 0x7F00, 0x10, "both upper"),
        (b"0x7f00 10 only start", 0x7F00, 0x10, "only start"),
        (b"7f00 0x10 only size", 0x7F00, 0x10, "only size"),
        (b"   7f00 10 leading spaces", 0x7F00, 0x10, "leading spaces"),
        (b"\t7f00\t10\ttabs and\ttabs", 0x7F00, 0x10, "tabs and\ttabs"),
        (b"7f00 10 crlf\r", 0x7F00, 0x10, "crlf"),
        (b"7f00 10 x", 0x7F00, 0x10, "x"),
        (b"ffffffffffffff00 ff top of memory", 0xFFFFFFFFFFFFFF00, 0xFF, "top of memory"),
        (b"7f00 10 caf\xc3\xa9", 0x7F00, 0x10, "caf\u00e9"),
        (b"7f00 10 bad \xff utf8", 0x7F00, 0x10, "bad \ufffd utf8"),
    ],
)
def test_accepted_line_forms(line: bytes, start: int, size: int, name: str) -> None:
    p = parse_lines(line + b"\n")
    assert (list(p.starts), list(p.ends), p.names) == ([start], [start + size], [name])
    assert p.malformed == 0


@pytest.mark.parametrize(
    "line",
    [
        b"zz00 10 bad hex",
        b"7f00 1g bad size hex",
        b"7f00 10",
        b"7f00 10 ",
        b"7f00",
        b"7f00 0 zero size",
        b"7f00 0x0 zero size",
        b"11111111111111111 10 seventeen digits",
        b"ffffffffffffffff 10 wraps past 2**64",
        b"ffffffffffffff00 100 ends at 2**64",
        b"7f00 10 nul\x00inside",
        b"\x00\x01\x02\x03",
        b"7f00,10,commas",
        b"7f00 10 cr\rinside",
        b"-7f00 10 negative",
        b"+7f00 10 plus sign",
        b"7f_00 10 underscore",
    ],
)
def test_malformed_lines_are_counted(line: bytes) -> None:
    p = parse_lines(line + b"\n")
    assert p.names == []
    assert p.malformed == 1


def test_blank_lines_are_silent_and_counts_are_exact() -> None:
    block = b"\n  \n\t\r\n7f00 10 a\n\r\nnot a line\n7f10 10 b\r\n\n"
    p = parse_lines(block)
    assert p.names == ["a", "b"]
    assert p.malformed == 1
    assert p.long_lines == 0


def test_long_line_in_block_is_skipped() -> None:
    long_name = b"n" * 200
    block = b"1000 10 ok\n2000 10 " + long_name + b"\n3000 10 also ok\nbad\n"
    p = parse_lines(block, max_line_bytes=64)
    assert p.names == ["ok", "also ok"]
    assert p.long_lines == 1
    assert p.malformed == 1


# -- incremental reading ---------------------------------------------------


def test_refresh_reads_only_appended_bytes(mapfile: Path) -> None:
    first = b"".join(b"%x 10 f%d\n" % (0x1000 + i * 16, i) for i in range(100))
    write(mapfile, first)
    pm = PerfMap(str(mapfile), UID)
    r = pm.refresh()
    assert (r.refused, r.reloaded, r.bytes_read, r.new_entries) == (None, False, len(first), 100)
    assert pm.stats.bytes_read == len(first)
    assert pm.lookup(0x1000 + 5 * 16 + 3) == "f5"

    extra = b"9000 20 appended one\n"
    append(mapfile, extra)
    r = pm.refresh()
    assert r.bytes_read == len(extra)
    assert r.new_entries == 1
    assert pm.stats.bytes_read == len(first) + len(extra)
    assert pm.lookup(0x9010) == "appended one"
    assert pm.lookup(0x1000) == "f0"

    r = pm.refresh()  # nothing new: nothing read
    assert r.bytes_read == 0
    assert pm.stats.bytes_read == len(first) + len(extra)
    assert pm.stats.lines_parsed == 101
    assert pm.stats.entries == 101


def test_partial_last_line_completes_later(mapfile: Path) -> None:
    write(mapfile, b"1000 10 whole\n2000 10 half")
    pm = PerfMap(str(mapfile), UID)
    r = pm.refresh()
    assert r.new_entries == 1
    assert r.remaining == len(b"2000 10 half")
    assert pm.lookup(0x2000) is None
    assert pm.refresh().bytes_read == 0  # unchanged file, pending tail not re-read

    append(mapfile, b"-written\n")
    r = pm.refresh()
    # The pending tail is read again together with its completion.
    assert r.bytes_read == len(b"2000 10 half-written\n")
    assert r.remaining == 0
    assert pm.lookup(0x2000) == "half-written"
    assert pm.stats.malformed == 0


def test_half_written_crlf_line(mapfile: Path) -> None:
    write(mapfile, b"1000 10 a\r")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    assert pm.lookup(0x1000) is None
    append(mapfile, b"\n")
    pm.refresh()
    assert pm.lookup(0x1000) == "a"


def test_truncation_reloads(mapfile: Path) -> None:
    write(mapfile, b"1000 10 old1\n2000 10 old2\n3000 10 old3\n")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    ino = os.stat(mapfile).st_ino
    with open(mapfile, "r+b") as fh:
        fh.truncate(0)
        fh.write(b"4000 10 new\n")
    assert os.stat(mapfile).st_ino == ino
    r = pm.refresh()
    assert r.reloaded
    assert pm.stats.reloads == 1
    assert pm.lookup(0x1000) is None
    assert pm.lookup(0x4000) == "new"


def test_rewrite_past_the_old_offset_reloads(mapfile: Path) -> None:
    """Truncated and rewritten longer between two refreshes: same inode,
    larger size, but the bytes before our offset changed."""
    write(mapfile, b"1000 10 old\n")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    with open(mapfile, "r+b") as fh:
        fh.truncate(0)
        fh.write(b"5000 10 brand new contents\n6000 10 more\n")
    r = pm.refresh()
    assert r.reloaded
    assert pm.lookup(0x1000) is None
    assert pm.lookup(0x5000) == "brand new contents"
    assert pm.lookup(0x6000) == "more"
    assert pm.stats.malformed == 0


def test_replacement_by_new_inode_reloads(mapfile: Path, tmp_path: Path) -> None:
    write(mapfile, b"1000 10 old\n")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    fresh = tmp_path / "fresh"
    write(fresh, b"1000 10 replaced\n")  # same length as before
    os.rename(fresh, mapfile)
    r = pm.refresh()
    assert r.reloaded
    assert pm.lookup(0x1000) == "replaced"


def test_entries_survive_a_temporary_refusal(mapfile: Path, tmp_path: Path) -> None:
    write(mapfile, b"1000 10 kept\n")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    os.rename(mapfile, tmp_path / "aside")
    r = pm.refresh()
    assert r.refused == "missing"
    assert pm.stats.refused["missing"] == 1
    assert pm.lookup(0x1000) == "kept"
    os.rename(tmp_path / "aside", mapfile)
    append(mapfile, b"2000 10 later\n")
    r = pm.refresh()
    assert not r.reloaded and r.new_entries == 1
    assert pm.lookup(0x1000) == "kept"


def test_read_budget_spreads_work(mapfile: Path) -> None:
    lines = [b"%x 10 f%d\n" % (0x1000 + i * 16, i) for i in range(50_000)]
    data = b"".join(lines)
    write(mapfile, data)
    pm = PerfMap(str(mapfile), UID, chunk_bytes=64 << 10)
    r = pm.refresh(max_bytes=64 << 10)
    assert 0 < r.bytes_read <= (64 << 10)
    assert r.remaining > 0
    total = r.new_entries
    while r.remaining:
        r = pm.refresh(max_bytes=64 << 10)
        total += r.new_entries
    assert total == 50_000
    assert pm.lookup(0x1000 + 49_999 * 16) == "f49999"


# -- newest entry wins -----------------------------------------------------


def test_same_address_later_line_wins(mapfile: Path) -> None:
    write(mapfile, b"1000 10 first\n1000 10 second\n")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    assert pm.lookup(0x1008) == "second"


def test_overlapping_later_line_carves_earlier_range(mapfile: Path) -> None:
    write(mapfile, b"1000 100 big old\n1040 20 small new\n")
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    assert pm.lookup(0x1000) == "big old"
    assert pm.lookup(0x103F) == "big old"
    assert pm.lookup(0x1040) == "small new"
    assert pm.lookup(0x105F) == "small new"
    assert pm.lookup(0x1060) == "big old"
    assert pm.lookup(0x10FF) == "big old"
    assert pm.lookup(0x1100) is None
    assert pm.symbols() == [
        (0x1000, 0x1040, "big old"),
        (0x1040, 0x1060, "small new"),
        (0x1060, 0x1100, "big old"),
    ]


def test_reuse_across_refreshes_and_index_rebuilds(mapfile: Path) -> None:
    base = b"".join(b"%x 10 gen0_%d\n" % (0x10000 + i * 16, i) for i in range(20_000))
    write(mapfile, base)
    pm = PerfMap(str(mapfile), UID)
    pm.refresh()
    assert pm.lookup(0x10000 + 7 * 16) == "gen0_7"
    # Many small appends re-using addresses: exercises the overlay and its
    # merge into the base.
    for gen in range(1, 40):
        chunk = b"".join(
            b"%x 10 gen%d_%d\n" % (0x10000 + i * 16, gen, i) for i in range(gen, 20_000, 97)
        )
        append(mapfile, chunk)
        pm.refresh()
        assert pm.lookup(0x10000 + gen * 16 + 3) == f"gen{gen}_{gen}"
    for i in range(0, 20_000, 331):
        newest = 0
        for gen in range(1, 40):
            if i >= gen and (i - gen) % 97 == 0:
                newest = gen
        assert pm.lookup(0x10000 + i * 16) == f"gen{newest}_{i}"


def test_processes_running_the_same_code_share_their_names(tmp_path: Path) -> None:
    """Many processes of one runtime write the same names at other addresses:
    each name is held once, not once per process."""
    readers = []
    for pid, base in ((1234, 0x10000), (1235, 0x7F0000)):
        path = tmp_path / f"perf-{pid}.map"
        write(path, b"".join(b"%x 10 Builtin:Fn%d\n" % (base + i * 16, i) for i in range(1000)))
        reader = PerfMap(str(path), UID)
        reader.refresh()
        readers.append((reader, base))
    (first, first_base), (second, second_base) = readers
    for i in (0, 17, 999):
        name = first.lookup(first_base + i * 16)
        assert name == f"Builtin:Fn{i}"
        assert second.lookup(second_base + i * 16) is name


# -- hostile files ---------------------------------------------------------


def test_symlink_to_real_map_is_refused(mapfile: Path, tmp_path: Path) -> None:
    real = tmp_path / "real.map"
    write(real, b"1000 10 secret\n")
    mapfile.symlink_to(real)
    pm = PerfMap(str(mapfile), UID)
    r = pm.refresh()
    assert r.refused == "symlink"
    assert pm.stats.refused["symlink"] == 1
    assert pm.stats.bytes_read == 0
    assert pm.lookup(0x1000) is None


def test_fifo_is_refused_without_hanging(mapfile: Path) -> None:
    os.mkfifo(mapfile)
    pm = PerfMap(str(mapfile), UID)
    t0 = time.monotonic()
    r = pm.refresh()
    assert time.monotonic() - t0 < 1.0
    assert r.refused == "not_regular"
    assert pm.stats.refused["not_regular"] == 1


@needs_root
def test_device_is_refused(mapfile: Path) -> None:
    os.mknod(mapfile, 0o020600, os.makedev(1, 5))  # /dev/zero's numbers
    pm = PerfMap(str(mapfile), UID)
    t0 = time.monotonic()
    assert pm.refresh().refused == "not_regular"
    assert time.monotonic() - t0 < 1.0
    assert pm.stats.bytes_read == 0


def test_dev_zero_by_path_is_refused() -> None:
    pm = PerfMap("/dev/zero", UID)
    assert pm.refresh().refused == "not_regular"


@needs_root
def test_foreign_owner_is_refused(mapfile: Path) -> None:
    write(mapfile, b"1000 10 planted\n")
    os.chown(mapfile, 12345, 12345)
    pm = PerfMap(str(mapfile), 1000)
    r = pm.refresh()
    assert r.refused == "foreign_owner"
    assert pm.stats.refused["foreign_owner"] == 1
    assert pm.lookup(0x1000) is None


def test_oversize_sparse_file_is_capped(mapfile: Path) -> None:
    head = b"".join(b"%x 10 f%d\n" % (0x1000 + i * 16, i) for i in range(1000))
    write(mapfile, head)
    with open(mapfile, "r+b") as fh:
        fh.truncate(16 << 30)  # 16 GiB of (sparse) NUL bytes after the lines
    cap = 1 << 20
    pm = PerfMap(str(mapfile), UID, max_file_bytes=cap, chunk_bytes=256 << 10)
    tracemalloc.start()
    try:
        t0 = time.monotonic()
        r = pm.refresh()
        elapsed = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.capped
    assert r.bytes_read <= cap
    assert pm.stats.bytes_read <= cap
    assert pm.stats.bytes_capped == (16 << 30) - cap
    assert r.new_entries == 1000
    assert pm.stats.long_lines == 1  # the NUL run has no newline
    assert peak < 8 * cap, f"peak traced memory {peak}"
    assert elapsed < 5
    assert pm.lookup(0x1000 + 999 * 16) == "f999"
    # Still capped on the next refresh, and nothing more is read.
    r = pm.refresh()
    assert r.capped and r.bytes_read == 0


def test_binary_garbage(mapfile: Path) -> None:
    rng = __import__("random").Random(7)
    garbage = bytes(rng.randrange(256) for _ in range(200_000))
    write(mapfile, garbage + b"\n1000 10 after garbage\n")
    pm = PerfMap(str(mapfile), UID, max_line_bytes=4096)
    r = pm.refresh()
    assert r.refused is None
    assert pm.stats.malformed + pm.stats.long_lines > 0
    assert pm.lookup(0x1000) == "after garbage"
    for addr in range(0, 1 << 64, 1 << 58):
        assert pm.lookup(addr) is None or isinstance(pm.lookup(addr), str)


def test_line_longer_than_cap_while_being_written(mapfile: Path) -> None:
    write(mapfile, b"1000 10 before\n2000 10 " + b"x" * 10_000)
    pm = PerfMap(str(mapfile), UID, max_line_bytes=256)
    pm.refresh()
    assert pm.stats.long_lines == 1
    assert pm.lookup(0x1000) == "before"
    append(mapfile, b"y" * 5000)  # still the same line
    r = pm.refresh()
    assert r.bytes_read == 5000  # the skipped part is not read again
    append(mapfile, b"zzz\n3000 10 after\n")
    pm.refresh()
    assert pm.stats.long_lines == 1
    assert pm.stats.malformed == 0
    assert pm.lookup(0x2000) is None
    assert pm.lookup(0x3000) == "after"


def test_max_entries(mapfile: Path) -> None:
    write(mapfile, b"".join(b"%x 10 f%d\n" % (0x1000 + i * 16, i) for i in range(100)))
    pm = PerfMap(str(mapfile), UID, max_entries=60)
    r = pm.refresh()
    assert r.new_entries == 60
    assert pm.stats.dropped_entries == 40
    assert pm.lookup(0x1000 + 59 * 16) == "f59"
    assert pm.lookup(0x1000 + 60 * 16) is None
    append(mapfile, b"9000 10 more\n")
    pm.refresh()
    assert pm.stats.dropped_entries == 41


# -- per-process paths -----------------------------------------------------


def test_perf_map_path() -> None:
    assert perf_map_path(4321, 7) == "/proc/4321/root/tmp/perf-7.map"
    assert perf_map_path(1, 1, proc_root="/host/proc") == "/host/proc/1/root/tmp/perf-1.map"
    for bad in (0, -1, True):
        with pytest.raises(ValueError):
            perf_map_path(bad, 1)


def test_for_process_reads_inside_the_mount_namespace(tmp_path: Path) -> None:
    root = tmp_path / "proc" / "4321" / "root"
    (root / "tmp").mkdir(parents=True)
    write(root / "tmp" / "perf-7.map", b"1000 10 in the container\n")
    pm = PerfMap.for_process(4321, 7, UID, proc_root=str(tmp_path / "proc"))
    assert pm.path == perf_map_path(4321, 7, str(tmp_path / "proc"))
    pm.refresh()
    assert pm.lookup(0x1000) == "in the container"


def test_for_process_never_falls_back_to_host_tmp(tmp_path: Path) -> None:
    nstgid = 2_000_000_000 + os.getpid() % 1000  # no such pid on the host
    host_map = Path(f"/tmp/perf-{nstgid}.map")
    root = tmp_path / "proc" / "4321" / "root"
    (root / "tmp").mkdir(parents=True)
    try:
        write(host_map, b"1000 10 host file\n")
        pm = PerfMap.for_process(4321, nstgid, UID, proc_root=str(tmp_path / "proc"))
        r = pm.refresh()
        assert r.refused == "missing"
        assert pm.lookup(0x1000) is None
    finally:
        host_map.unlink(missing_ok=True)


def test_for_process_refuses_tmp_symlinked_out_of_the_container(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    write(outside / "perf-7.map", b"1000 10 escaped\n")
    root = tmp_path / "proc" / "4321" / "root"
    root.mkdir(parents=True)
    (root / "tmp").symlink_to(outside)
    pm = PerfMap.for_process(4321, 7, UID, proc_root=str(tmp_path / "proc"))
    assert pm.refresh().refused == "symlink"
    assert pm.lookup(0x1000) is None


def test_written_says_whether_a_read_would_find_a_file_and_reads_nothing(
        tmp_path: Path) -> None:
    """The cheap check a young interpreter's look makes: a file of this
    process is there; nothing, a stale file, a FIFO or a way out of the
    container is not."""
    proc = tmp_path / "proc"
    tmp = proc / "4321" / "root" / "tmp"
    tmp.mkdir(parents=True)
    started = time.time_ns()
    pm = PerfMap.for_process(4321, 7, UID, proc_root=str(proc), not_before_ns=started)
    fds = _open_fds()
    assert not pm.written()  # no file yet
    write(tmp / "perf-7.map", b"1000 10 earlier process\n")
    os.utime(tmp / "perf-7.map", ns=(started - 10**9, started - 10**9))
    assert not pm.written()  # left by an earlier process with the pid
    append(tmp / "perf-7.map", b"2000 10 this process\n")
    assert pm.written()
    assert pm.stats.bytes_read == 0 and not any(pm.stats.refused.values())
    assert _open_fds() == fds
    (tmp / "perf-7.map").unlink()
    os.mkfifo(tmp / "perf-7.map")
    assert not pm.written()
    (tmp / "perf-7.map").unlink()
    outside = tmp_path / "outside"
    outside.mkdir()
    write(outside / "perf-7.map", b"1000 10 escaped\n")
    tmp.rmdir()
    tmp.symlink_to(outside)
    assert not pm.written()
    assert _open_fds() == fds


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_after_its_process_exited_the_file_is_read_to_the_end() -> None:
    """A real process writes its perf map in its /tmp, is read once while it
    runs, appends and exits: its /proc/PID/root is gone, the reader reads
    the rest of the same file through the descriptor it kept."""
    import sys
    child = subprocess.Popen([sys.executable, "-c", (
        "import os, sys\n"
        "path = f'/tmp/perf-{os.getpid()}.map'\n"
        "with open(path, 'w') as f:\n"
        "    f.write('1000 10 early\\n'); f.flush()\n"
        "    print('ready', flush=True); sys.stdin.readline()\n"
        "    f.write('2000 10 late\\n')\n")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    path = Path(f"/tmp/perf-{child.pid}.map")
    try:
        assert child.stdout is not None and child.stdout.readline() == "ready\n"
        pm = PerfMap.for_process(child.pid, child.pid, UID)
        pm.refresh()
        assert pm.lookup(0x1000) == "early" and pm.lookup(0x2000) is None
        child.communicate("go\n", timeout=30)
        assert not Path(f"/proc/{child.pid}").exists()
        result = pm.refresh()
        assert result.refused is None and result.new_entries == 1
        assert pm.lookup(0x2000) == "late"
        # The reader let go: so does its descriptor.
        before = _open_fds()
        del pm
        assert _open_fds() == before - 1
    finally:
        child.kill()
        child.wait()
        path.unlink(missing_ok=True)


def test_a_file_gone_while_its_process_runs_is_not_read_through_the_kept_one(
        tmp_path: Path) -> None:
    root = tmp_path / "proc" / "4321" / "root"
    (root / "tmp").mkdir(parents=True)
    write(root / "tmp" / "perf-7.map", b"1000 10 first\n")
    pm = PerfMap.for_process(4321, 7, UID, proc_root=str(tmp_path / "proc"))
    pm.refresh()
    append(root / "tmp" / "perf-7.map", b"2000 10 appended\n")
    (root / "tmp" / "perf-7.map").unlink()
    assert pm.refresh().refused == "missing"  # the root is there: the path decides
    assert pm.lookup(0x2000) is None
    (root / "tmp").rmdir()
    root.rmdir()  # now the process is gone
    assert pm.refresh().refused is None
    assert pm.lookup(0x2000) == "appended"


def test_no_more_than_max_kept_descriptors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           ) -> None:
    from tramprof.symbols import tailreader
    monkeypatch.setattr(tailreader, "MAX_KEPT", tailreader._Kept.total)  # none more
    root = tmp_path / "proc" / "4321" / "root"
    (root / "tmp").mkdir(parents=True)
    write(root / "tmp" / "perf-7.map", b"1000 10 first\n")
    pm = PerfMap.for_process(4321, 7, UID, proc_root=str(tmp_path / "proc"))
    before = _open_fds()
    pm.refresh()
    assert _open_fds() == before
    shutil.rmtree(tmp_path / "proc")
    assert pm.refresh().refused == "missing"
    assert pm.lookup(0x1000) == "first"  # what was read stays


# -- a real writer -----------------------------------------------------------

SPIN_JS = """
function spin(ms) {
  const end = Date.now() + ms;
  let x = 0;
  while (Date.now() < end) { x += Math.sqrt(x + 1); }
  return x;
}
spin(1000);
process.stdout.write("ready\\n");
process.stdin.on("data", () => process.exit(0));
"""


@pytest.fixture
def node_process(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: no real perf map writer to test against")
    script = tmp_path / "spin.js"
    script.write_text(SPIN_JS)
    proc = subprocess.Popen(
        [node, "--perf-basic-prof", str(script)],
        cwd=tmp_path,  # node may write isolate-*.log files into its working directory
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)
        Path(f"/tmp/perf-{proc.pid}.map").unlink(missing_ok=True)


def test_node_perf_basic_prof(node_process: subprocess.Popen[str], tmp_path: Path) -> None:
    pid = node_process.pid
    pm = PerfMap.for_process(pid, pid, os.geteuid())
    r = pm.refresh()
    assert r.refused is None, r
    assert r.new_entries > 100
    assert pm.stats.malformed == 0
    spins = [(s, e, n) for s, e, n in pm.symbols() if "spin " in n and "spin.js" in n]
    assert spins, "V8 wrote no entry for spin()"
    for start, end, name in spins:
        assert pm.lookup(start) == name
        assert pm.lookup(end - 1) == name
    # Names look like "JS:*spin /path/spin.js:2:14" (tier marker varies).
    assert any(n.split(" ", 1)[0].endswith("spin") for _, _, n in spins)


def test_memory_estimate_matches_what_the_index_really_holds(tmp_path: Path) -> None:
    """The symbol memory budget counts memory_bytes(); it must be close to what
    tracemalloc sees the reader hold (within 25%)."""
    from tramprof.symbols.names import SHARED_NAMES

    from .traced import traced_bytes

    path = tmp_path / "perf-1.map"
    n = 100_000
    with open(path, "w") as f:
        for i in range(n):
            f.write(f"{0x7f0000000000 + i * 64:x} 30 py::function_{i}:/srv/app/mod_{i % 50}.py\n")
    def build() -> PerfMap:
        reader = PerfMap(str(path), None)
        reader.refresh()
        assert reader.lookup(0x7f0000000000 + 5 * 64) is not None  # the index is built
        return reader

    # The table sharing names between processes is bounded on its own
    # (symbols.names), not by the readers' estimates: left out here.
    SHARED_NAMES.clear()
    reader, held = traced_bytes(lambda: (build(), SHARED_NAMES.clear())[0])
    estimate = reader.memory_bytes()
    assert 0.75 * held <= estimate <= 1.25 * held, (estimate, held)


def test_a_streaming_reader_hands_each_entry_over_once_and_keeps_no_index(tmp_path: Path
                                                                          ) -> None:
    path = tmp_path / "perf-1.map"
    path.write_text("1000 10 py::a:x.py\n2000 10 b\n3000 1")  # last line unfinished
    seen: list[tuple[int, int, str]] = []
    reader = PerfMap(str(path), None, on_entries=lambda parsed: seen.extend(
        zip(parsed.starts, parsed.ends, parsed.names, strict=True)))
    reader.refresh()
    assert seen == [(0x1000, 0x1010, "py::a:x.py"), (0x2000, 0x2010, "b")]
    with open(path, "a") as f:
        f.write("0 py::c:y.py\n")
    reader.refresh()
    reader.refresh()
    assert seen[2:] == [(0x3000, 0x3010, "py::c:y.py")]
    assert reader.lookup(0x1000) is None and reader.memory_bytes() == 0
    assert reader.stats.entries == 3
