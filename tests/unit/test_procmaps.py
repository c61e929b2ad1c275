"""/proc/PID/maps parsing and mapping lookup."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tramprof.model import ProcessGone, SymbolizationError
from tramprof.procfs.maps import (
    Mapping,
    find_mapping,
    parse_maps,
    parse_maps_line,
    process_exited,
    read_maps,
)

MAPS = """\
55a10849e000-55a1084a0000 r--p 00000000 fe:00 260131                     /usr/bin/cat
55a1084a0000-55a1084a5000 r-xp 00002000 fe:00 260131                     /usr/bin/cat
55a12851c000-55a12853d000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000001000 r-xp 00000000 00:00 0\x20
7f0000001000-7f0000002000 rwxp 00000000 00:00 0                          [anon:v8 jit]
7f0000002000-7f0000003000 r-xs 00000000 00:01 4242                       /memfd:jit code (deleted)
7f0000003000-7f0000004000 r-xs 00000000 00:01 17                         /dev/zero (deleted)
7f0000010000-7f0000020000 r-xp 00001000 fe:00 999                        /opt/my app/lib foo.so
7f0000020000-7f0000030000 r-xp 00001000 fe:00 1000      /opt/my app/lib foo.so (deleted)
7f0000030000-7f0000031000 r-xp 00000000 00:00 0                          //anon
7ffd1b5f0000-7ffd1b611000 rw-p 00000000 00:00 0                          [stack]
7ffd1b7d6000-7ffd1b7d8000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


@pytest.fixture
def maps() -> dict[str, Mapping]:
    return {m.path: m for m in parse_maps(MAPS)}


def test_fields(maps: dict[str, Mapping]) -> None:
    m = parse_maps(MAPS)[1]
    assert m == Mapping(
        start=0x55A1084A0000,
        end=0x55A1084A5000,
        perms="r-xp",
        offset=0x2000,
        dev_major=0xFE,
        dev_minor=0,
        inode=260131,
        path="/usr/bin/cat",
    )
    assert m.size == 0x5000
    assert m.is_exec and m.is_file_backed
    assert not (m.is_anonymous or m.is_special or m.is_deleted or m.is_vdso)
    assert m.basename == "cat"
    assert not maps["[heap]"].is_exec


def test_paths_with_spaces_survive(maps: dict[str, Mapping]) -> None:
    m = maps["/opt/my app/lib foo.so"]
    assert m.inode == 999
    assert m.basename == "lib foo.so"
    assert not m.is_deleted


def test_deleted(maps: dict[str, Mapping]) -> None:
    m = maps["/opt/my app/lib foo.so (deleted)"]
    assert m.is_deleted
    assert m.file_path == "/opt/my app/lib foo.so"
    assert m.basename == "lib foo.so"
    assert m.is_file_backed and not m.is_anonymous_exec


def test_anonymous_exec(maps: dict[str, Mapping]) -> None:
    assert maps[""].is_anonymous_exec
    assert maps["[anon:v8 jit]"].is_anonymous_exec
    assert not maps["[anon:v8 jit]"].is_special
    assert maps["//anon"].is_anonymous_exec
    assert maps["/dev/zero (deleted)"].is_anonymous_exec  # shared anonymous memory
    assert not maps["[heap]"].is_anonymous_exec  # not executable


def test_memfd_is_file_backed_not_anonymous(maps: dict[str, Mapping]) -> None:
    m = maps["/memfd:jit code (deleted)"]
    assert m.is_memfd and m.is_deleted and m.is_file_backed
    assert not m.is_anonymous_exec
    assert m.basename == "memfd:jit code"


def test_special(maps: dict[str, Mapping]) -> None:
    for path in ("[heap]", "[stack]", "[vdso]", "[vsyscall]"):
        assert maps[path].is_special, path
        assert not maps[path].is_file_backed
    assert maps["[vdso]"].is_vdso
    assert maps["[vsyscall]"].is_exec
    assert maps["[vsyscall]"].end == 0xFFFFFFFFFF601000


def test_malformed_lines() -> None:
    for bad in ("", "nonsense", "1000-2000 r-xp 0 fe00 1 /x", "zz-2000 r-xp 0 fe:00 1"):
        with pytest.raises(ValueError):
            parse_maps_line(bad)
    with pytest.raises(ValueError, match="end < start"):
        parse_maps_line("2000-1000 r-xp 00000000 fe:00 1 /x")


@given(
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="\n"),
        min_size=1,
        max_size=40,
    )
)
def test_any_path_round_trips(name: str) -> None:
    path = "/" + name.strip("\x0b\x0c\x1c\x1d\x1e\x1f\x85\u2028\u2029")
    line = f"7f0000010000-7f0000020000 r-xp 00001000 fe:00 999                 {path}\n"
    assert parse_maps_line(line).path == path


def test_mappings_are_equal_and_hash_alike_by_their_fields() -> None:
    """Mappings key the symbolizer's state across re-reads of the maps: the
    same line read again is the same key; any other field makes another."""
    first, again = parse_maps(MAPS), parse_maps(MAPS)
    assert {m: i for i, m in enumerate(first)} == {m: i for i, m in enumerate(again)}
    cat = first[1]
    assert hash(cat) == hash(again[1])
    for changed in (cat._replace(offset=0x3000), cat._replace(inode=1),
                    cat._replace(path="/usr/bin/dog")):
        assert changed != cat and changed not in set(again)


def test_find_mapping_boundaries() -> None:
    ms = parse_maps(MAPS)
    cat = ms[1]
    assert find_mapping(ms, cat.start) is cat
    assert find_mapping(ms, cat.end - 1) is cat
    assert find_mapping(ms, cat.end) is None  # gap before [heap]
    assert find_mapping(ms, 0) is None
    assert find_mapping(ms, 2**64 - 1) is None
    assert find_mapping([], 0x1000) is None
    assert find_mapping(ms, 0xFFFFFFFFFF600010) is ms[-1]


def _fake_proc(tmp_path: Path, pid: int, maps: str | None, state: str = "S",
               threads: int = 1) -> str:
    d = tmp_path / str(pid)
    d.mkdir()
    if maps is not None:
        (d / "maps").write_text(maps)
    # state ppid pgrp session tty tpgid flags, 4 fault counts, utime stime
    # cutime cstime priority nice num_threads itrealvalue starttime, and on.
    fields = [state, 1, 1, 1, 0, -1, 0, 0, 0, 0, 0, 3, 4, 0, 0, 20, 0, threads, 0, 1234,
              *[0] * 30]
    (d / "stat").write_text(f"{pid} (a) b) {' '.join(map(str, fields))}\n")
    return str(tmp_path)


def test_read_maps_from_proc_root(tmp_path: Path) -> None:
    root = _fake_proc(tmp_path, 4242, MAPS)
    ms = read_maps(4242, root)
    assert len(ms) == len(MAPS.splitlines())
    assert [m.start for m in ms] == sorted(m.start for m in ms)


def test_read_maps_process_gone(tmp_path: Path) -> None:
    with pytest.raises(ProcessGone) as exc:
        read_maps(4242, str(tmp_path))
    assert exc.value.pid == 4242
    assert isinstance(exc.value, SymbolizationError)


def test_empty_maps_of_zombie_is_gone_of_kernel_thread_is_empty(tmp_path: Path) -> None:
    root = _fake_proc(tmp_path, 1, "", state="Z")
    assert process_exited(1, root)
    with pytest.raises(ProcessGone):
        read_maps(1, root)
    root = _fake_proc(tmp_path, 2, "", state="I")
    assert not process_exited(2, root)
    assert read_maps(2, root) == []
    # The main thread exited, another runs on: its maps show elsewhere.
    root = _fake_proc(tmp_path, 3, "", state="Z", threads=2)
    assert not process_exited(3, root)
    assert read_maps(3, root) == []


def test_read_maps_malformed_is_symbolization_error(tmp_path: Path) -> None:
    root = _fake_proc(tmp_path, 7, "this is not a maps file\n")
    with pytest.raises(SymbolizationError, match="malformed"):
        read_maps(7, root)


def test_real_exited_process_is_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_exited(proc.pid)
    with pytest.raises(ProcessGone):
        read_maps(proc.pid)


def test_real_own_maps() -> None:
    ms = read_maps(os.getpid())
    libc = ctypes.CDLL(None)
    addr = ctypes.cast(libc.getpid, ctypes.c_void_p).value
    assert addr is not None
    m = find_mapping(ms, addr)
    assert m is not None
    assert m.is_exec and m.is_file_backed
    assert m.basename.startswith("libc")
    assert not process_exited(os.getpid())


# --- hostile file names: they are the mapping process's to choose ------------

INJECTED = "7f0000100000-7f0025900000 r-xp 00000000 00:00 0                          [vdso]"


@pytest.mark.parametrize("separator", ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85",
                                       "\u2028", "\u2029"])
def test_a_line_break_other_than_newline_in_a_name_injects_nothing(separator: str) -> None:
    """The kernel escapes only \\n in names; every other line break must stay
    inside the one mapping it belongs to."""
    text = (f"55a1084a0000-55a1084a5000 r-xp 00002000 fe:00 260131     /tmp/x{separator}"
            f"{INJECTED}\n7ffd1b1f0000-7ffd1b1f2000 r-xp 00000000 00:00 0  [vdso]\n")
    maps = parse_maps(text.encode("utf-8"))
    assert len(maps) == 2
    assert maps[0].path == f"/tmp/x{separator}{INJECTED}" and not maps[0].is_special
    assert [m.start for m in maps if m.is_vdso] == [0x7ffd1b1f0000]


@given(st.binary(min_size=1, max_size=200).filter(lambda b: b"\n" not in b))
def test_any_bytes_in_a_name_give_exactly_one_mapping(name: bytes) -> None:
    line = b"7f0000010000-7f0000020000 r-xp 00001000 fe:00 999                 /" + name
    maps = parse_maps(line + b"\n" + b"7f0000030000-7f0000031000 r-xp 00000000 00:00 0 \n")
    assert len(maps) == 2
    path = maps[0].path
    # The name survives byte for byte (bar the padding spaces it may start with).
    assert path.encode("utf-8", "surrogateescape") == b"/" + name
    shown = maps[0].display_path
    shown.encode("utf-8")  # always valid UTF-8: metrics and protobuf accept it
    assert shown.isprintable()


_LINE_PARTS = st.tuples(
    st.sampled_from(["7f0000010000-7f0000020000", "1000-2000", "2000-1000", "10-0x20", "A0-B0"]),
    st.sampled_from(["r-xp", "---p", "R-XP", ""]),
    st.sampled_from(["00001000", "0", "0x10", "1_0"]),
    st.sampled_from(["fe:00", "00:00", "FE:0a", "fe00"]),
    st.sampled_from(["999", "0", "+5", "x"]),
    st.binary(max_size=30).filter(lambda b: b"\n" not in b))


@given(st.lists(_LINE_PARTS, max_size=6), st.booleans())
def test_a_whole_file_parses_as_its_lines_do(lines, final_newline: bool) -> None:
    """The file is parsed with one pattern where every line is the kernel's
    format; the result (or the error) is always that of line by line."""
    text = b"\n".join(b" ".join(part.encode() for part in parts[:5]) + b"    " + parts[5]
                      for parts in lines) + (b"\n" if final_newline else b"")
    try:
        expected = sorted((parse_maps_line(line.decode("utf-8", "surrogateescape"))
                           for line in text.split(b"\n") if line.strip(b" ")),
                          key=lambda m: m.start)
    except ValueError:
        with pytest.raises(ValueError):
            parse_maps(text)
        return
    parsed = parse_maps(text)
    assert [tuple(m) for m in parsed] == [tuple(m) for m in expected]


def test_real_process_mapping_a_file_named_with_a_fake_vdso_line(tmp_path: Path) -> None:
    """A process maps a file whose name carries \\r and a fake 600 MiB [vdso]
    line: the daemon's reader sees the file once and the real vdso once."""
    hostile = tmp_path / f"lib\r{INJECTED}"
    hostile.write_bytes(b"\0" * 4096)
    code = ("import mmap, sys, os\n"
            "f = open(sys.argv[1], 'rb')\n"
            "m = mmap.mmap(f.fileno(), 4096, prot=mmap.PROT_READ)\n"
            "print('ready', flush=True); sys.stdin.readline()\n")
    proc = subprocess.Popen([sys.executable, "-c", code, str(hostile)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        maps = read_maps(proc.pid)
    finally:
        proc.communicate("\n", timeout=10)
    vdso = [m for m in maps if m.is_vdso]
    assert len(vdso) == 1 and vdso[0].size <= 64 << 10
    assert [m.path for m in maps if m.inode == hostile.stat().st_ino] == [str(hostile)]


def test_a_maps_file_over_the_cap_is_refused(tmp_path: Path, monkeypatch) -> None:
    from tramprof.procfs import maps as procmaps

    monkeypatch.setattr(procmaps, "MAX_MAPS_BYTES", 100)
    (tmp_path / "5").mkdir()
    (tmp_path / "5" / "maps").write_text(
        "7f0000010000-7f0000020000 r-xp 00001000 fe:00 999 /x\n" * 3)
    with pytest.raises(SymbolizationError, match="larger than 100 bytes"):
        read_maps(5, str(tmp_path))
