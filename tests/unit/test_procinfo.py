"""tramprof.procfs.identity: /proc readers on fixture trees and on the live /proc."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tramprof.model import ProcessGone as SymbolsProcessGone
from tramprof.procfs.identity import (
    ProcessGone,
    ProcessIdentity,
    boottime_ns_to_ticks,
    list_pids,
    parse_stat,
    read_cgroup,
    read_cmdline,
    read_comm,
    read_exe,
    read_identity,
    read_proc_file,
    read_start_ticks,
    read_stat,
    read_status_ids,
)


def stat_line(
    pid: int,
    comm: str,
    *,
    state: str = "S",
    ppid: int = 1,
    num_threads: int = 1,
    start: int = 4242,
    start_code: int = 0x5555_0000,
    end_code: int = 0x5555_8000,
    start_stack: int = 0x7FFD_0000,
) -> str:
    """A 52-field /proc/PID/stat line; fields 3.. as the kernel prints them."""
    fields = [0] * 50  # fields 3..52
    fields[4 - 3] = ppid
    fields[20 - 3] = num_threads
    fields[22 - 3] = start
    fields[26 - 3] = start_code
    fields[27 - 3] = end_code
    fields[28 - 3] = start_stack
    rest = [state, *map(str, fields[1:])]
    return f"{pid} ({comm}) {' '.join(rest)}\n"


def make_proc(root: Path, pid: int, comm: str = "prog", **stat: int | str) -> Path:
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(stat_line(pid, comm, **stat))  # type: ignore[arg-type]
    (d / "comm").write_text(comm + "\n")
    return d


# --- /proc/PID/stat -----------------------------------------------------------


@pytest.mark.parametrize("comm", ["a) b (c", "x", "with space", ") (", "((", "))", "p)S 1 2"])
def test_stat_comm_with_parens_and_spaces(tmp_path: Path, comm: str) -> None:
    make_proc(tmp_path, 77, comm, start=123456, ppid=9, num_threads=3, state="R")
    st = read_stat(77, str(tmp_path))
    assert st.comm == comm
    assert st.state == "R"
    assert st.ppid == 9
    assert st.num_threads == 3
    assert st.start_ticks == 123456
    assert read_start_ticks(77, str(tmp_path)) == 123456
    assert read_identity(77, str(tmp_path)) == ProcessIdentity(77, 123456)


def test_stat_exec_signature_hidden_or_visible() -> None:
    visible = parse_stat(1, stat_line(1, "x", start_code=10, end_code=20, start_stack=30).encode())
    assert visible.exec_signature == (10, 20, 30)
    # Not allowed to ptrace: the kernel prints 1 1 0.
    hidden = parse_stat(1, stat_line(1, "x", start_code=1, end_code=1, start_stack=0).encode())
    assert hidden.exec_signature is None
    kthread = parse_stat(1, stat_line(1, "x", start_code=0, end_code=0, start_stack=0).encode())
    assert kthread.exec_signature is None


def test_stat_vsize_is_the_address_space_the_kernel_reports() -> None:
    """Field 23, in bytes: the same figure as status's VmSize (in KiB), and
    it moves when a mapping is made."""
    import mmap
    import os
    # Another thread of this process (an earlier test's) may map or unmap
    # memory between two reads: compare a VmSize read between two equal ones.
    for _ in range(100):
        before = read_stat(os.getpid()).vsize
        status = Path("/proc/self/status").read_text()
        if read_stat(os.getpid()).vsize == before:
            break
    vm_kib = int(next(line.split()[1] for line in status.splitlines()
                      if line.startswith("VmSize:")))
    assert before == vm_kib * 1024
    with mmap.mmap(-1, 64 << 20):
        assert read_stat(os.getpid()).vsize - before >= 64 << 20


def test_stat_dead_means_zombie_without_live_threads() -> None:
    assert parse_stat(1, stat_line(1, "x", state="Z").encode()).is_dead
    assert parse_stat(1, stat_line(1, "x", state="X").encode()).is_dead
    # A zombie leader whose other threads still run: the process is alive.
    assert not parse_stat(1, stat_line(1, "x", state="Z", num_threads=4).encode()).is_dead
    assert not parse_stat(1, stat_line(1, "x", state="S").encode()).is_dead


@pytest.mark.parametrize("data", [b"", b"12 no parens here", b"12 (x) S 1 2 3"])
def test_stat_malformed(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_stat(12, data)


def test_stat_empty_file_means_gone(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 5)
    (d / "stat").write_bytes(b"")
    with pytest.raises(ProcessGone):
        read_stat(5, str(tmp_path))


# --- other files ---------------------------------------------------------------


def test_comm_keeps_inner_whitespace(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 3)
    (d / "comm").write_bytes(b"a) b (c \n")
    assert read_comm(3, str(tmp_path)) == "a) b (c "
    (d / "comm").write_bytes(b"bad\xffname\n")
    assert read_comm(3, str(tmp_path)) == "bad\ufffdname"


def test_cmdline(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 3)
    (d / "cmdline").write_bytes(b"/bin/prog\0--flag\0two words\0")
    assert read_cmdline(3, str(tmp_path)) == ["/bin/prog", "--flag", "two words"]
    (d / "cmdline").write_bytes(b"")  # kernel thread or zombie
    assert read_cmdline(3, str(tmp_path)) == []
    (d / "cmdline").write_bytes(b"rewritten title: worker 3")  # setproctitle
    assert read_cmdline(3, str(tmp_path)) == ["rewritten title: worker 3"]
    (d / "cmdline").write_bytes(b"a\0\0b\0")  # empty argument in the middle
    assert read_cmdline(3, str(tmp_path)) == ["a", "", "b"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("0::/system.slice/nginx.service\n", "/system.slice/nginx.service"),
        ("0::/\n", "/"),
        (
            "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
            "/docker/abc",
        ),
        (
            # hybrid: the controllers live in v1, the 0:: line has none
            "4:memory:/job/7\n2:cpu:/\n0::/\n",
            "memory:/job/7;cpu:/",
        ),
        ("", ""),
    ],
)
def test_cgroup(tmp_path: Path, content: str, expected: str) -> None:
    d = make_proc(tmp_path, 3)
    (d / "cgroup").write_text(content)
    assert read_cgroup(3, str(tmp_path)) == expected


def test_nstgid(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 3)
    ids = b"Uid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n"
    (d / "status").write_bytes(
        b"Name:\ta) b\nTgid:\t4321\nNgid:\t0\nPid:\t4321\n"
        b"NStgid:\t4321\t17\t1\nNSpid:\t4321\t17\t1\n" + ids
    )
    assert read_status_ids(3, str(tmp_path)).nstgid == (4321, 17, 1)
    (d / "status").write_bytes(b"Name:\tx\nTgid:\t4321\nPid:\t4321\n" + ids)  # kernel < 4.1
    assert read_status_ids(3, str(tmp_path)).nstgid == (4321,)


def test_status_ids_come_from_one_read(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 3)
    (d / "status").write_bytes(
        b"Name:\tUid: 0 0 0 0\nTgid:\t4321\nNStgid:\t4321\t17\n"
        b"Uid:\t1000\t1001\t1000\t1001\nGid:\t50\t51\t50\t51\n"
    )
    ids = read_status_ids(3, str(tmp_path))
    assert (ids.nstgid, ids.inner_pid, ids.euid, ids.egid) == ((4321, 17), 17, 1001, 51)
    (d / "status").write_bytes(b"Name:\tx\nTgid:\t4321\nUid:\t0\t0\t0\t0\n")
    with pytest.raises(ValueError, match="Gid"):
        read_status_ids(3, str(tmp_path))


def test_exe(tmp_path: Path) -> None:
    d = make_proc(tmp_path, 3)
    (d / "exe").symlink_to("/usr/bin/prog (deleted)")
    assert read_exe(3, str(tmp_path)) == "/usr/bin/prog (deleted)"
    make_proc(tmp_path, 4)  # no exe link: kernel thread or zombie
    assert read_exe(4, str(tmp_path)) is None
    with pytest.raises(ProcessGone):
        read_exe(5, str(tmp_path))


def test_list_pids(tmp_path: Path) -> None:
    for name in ("1", "22", "303", "abc", "sys", "12a"):
        (tmp_path / name).mkdir()
    (tmp_path / "self").symlink_to("22")
    (tmp_path / "uptime").write_text("1.0 1.0\n")
    assert list_pids(str(tmp_path)) == [1, 22, 303]


@pytest.mark.parametrize(
    "reader",
    [read_stat, read_comm, read_cmdline, read_cgroup, read_status_ids,
     read_start_ticks],
)
def test_vanished_process_raises_process_gone(tmp_path: Path, reader: object) -> None:
    assert callable(reader)
    with pytest.raises(ProcessGone) as info:
        reader(999, str(tmp_path))
    assert info.value.pid == 999
    # The same class the symbolizer raises, so one except clause covers both.
    assert isinstance(info.value, SymbolsProcessGone)


# --- live /proc ------------------------------------------------------------------


def test_live_self() -> None:
    pid = os.getpid()
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    assert read_start_ticks(pid) == int(fields[22 - 3])
    st = read_stat(pid)
    assert st.ppid == os.getppid()
    assert st.state in ("R", "S")
    assert st.exec_signature is not None  # our own process: visible
    assert read_exe(pid) == os.path.realpath(sys.executable)
    assert read_cmdline(pid) == sys.orig_argv
    assert read_comm(pid) == Path(f"/proc/{pid}/comm").read_text().rstrip("\n")
    ids = read_status_ids(pid)
    assert (ids.nstgid[0], ids.euid, ids.egid) == (pid, os.geteuid(), os.getegid())
    assert read_cgroup(pid) != ""
    assert pid in list_pids()


def test_live_reaped_child_is_gone() -> None:
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    with pytest.raises(ProcessGone):
        read_stat(child.pid)


def test_live_zombie_is_dead() -> None:
    child = subprocess.Popen(["/bin/true"])
    try:
        deadline = time.monotonic() + 5
        while not read_stat(child.pid).is_dead:
            assert time.monotonic() < deadline, "child did not become a zombie"
            time.sleep(0.005)
        assert read_exe(child.pid) is None
        assert read_cmdline(child.pid) == []
    finally:
        child.wait()


# --- boottime ns -> ticks -----------------------------------------------------


def test_boottime_to_ticks_user_hz_100() -> None:
    assert boottime_ns_to_ticks(0, 100) == 0
    assert boottime_ns_to_ticks(9_999_999, 100) == 0
    assert boottime_ns_to_ticks(10_000_000, 100) == 1
    assert boottime_ns_to_ticks(1_234_567_890_123, 100) == 123_456
    assert boottime_ns_to_ticks(4_000_000, 250) == 1


def test_boottime_to_ticks_other_kernel_branches() -> None:
    # USER_HZ % 512 == 0 (alpha: 1024): x * USER_HZ / 512 / (NSEC_PER_SEC / 512)
    assert boottime_ns_to_ticks(1_000_000_000, 1024) == 1024
    assert boottime_ns_to_ticks(976_562, 1024) == 0
    assert boottime_ns_to_ticks(976_563, 1024) == 1
    # Neither (e.g. 300): x * 9 / ((9 * NSEC_PER_SEC + USER_HZ / 2) / USER_HZ)
    divisor = (9 * 1_000_000_000 + 150) // 300
    for ns in (0, 1, 3_333_333, 3_333_334, 10**12 + 7):
        assert boottime_ns_to_ticks(ns, 300) == ns * 9 // divisor
    assert boottime_ns_to_ticks(10**12, 300) == 300_000


def test_boottime_to_ticks_default_is_sysconf() -> None:
    hz = os.sysconf("SC_CLK_TCK")
    assert boottime_ns_to_ticks(10**12) == boottime_ns_to_ticks(10**12, hz)
    with pytest.raises(ValueError):
        boottime_ns_to_ticks(1, 0)


def test_boottime_matches_proc_start_time() -> None:
    """A child's start time converted from CLOCK_BOOTTIME brackets what /proc shows.

    The kernel stamps ``start_boottime`` with the boot-time clock between our
    two readings, so /proc's ticks lie between their conversions; this pins
    the clock (boottime, not monotonic) and the unit conversion.
    """
    before = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
    child = subprocess.Popen(["/bin/sleep", "5"])
    try:
        after = time.clock_gettime_ns(time.CLOCK_BOOTTIME)
        ticks = read_start_ticks(child.pid)
        assert boottime_ns_to_ticks(before) <= ticks <= boottime_ns_to_ticks(after)
        identity = ProcessIdentity.from_boottime(child.pid, before)
        assert identity.pid == child.pid
        assert identity.start_ticks <= ticks
    finally:
        child.kill()
        child.wait()


def test_identity_is_hashable_and_frozen() -> None:
    a = ProcessIdentity(1, 100)
    assert a == ProcessIdentity(1, 100)
    assert a != ProcessIdentity(1, 200)
    assert len({a, ProcessIdentity(1, 100), ProcessIdentity(1, 200)}) == 2
    with pytest.raises(AttributeError):
        a.pid = 2  # type: ignore[misc]


def test_a_proc_file_is_read_whole_or_up_to_its_limit(tmp_path: Path) -> None:
    """Across the chunk size (64 KiB), exactly: a bounded read stops at the
    limit, an unbounded one reads to the end; a missing process is gone."""
    data = bytes(range(256)) * 800  # 204,800 bytes: four chunks
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "maps").write_bytes(data)
    assert read_proc_file(7, "maps", str(tmp_path)) == data
    for limit in (0, 1, 65_536, 65_537, 70_000, len(data), len(data) + 1):
        assert read_proc_file(7, "maps", str(tmp_path), limit=limit) == data[:limit]
    with pytest.raises(ProcessGone, match="cannot read maps"):
        read_proc_file(8, "maps", str(tmp_path))
