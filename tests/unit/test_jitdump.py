"""jitdump reader: records in both byte orders, incremental reads, damage."""

from __future__ import annotations

import os
import platform
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from tramprof.symbols.jitdump import (
    CODE_CLOSE,
    CODE_LOAD,
    CODE_MOVE,
    DEBUG_INFO,
    JITDUMP_MAGIC,
    UNWINDING_INFO,
    JitDump,
    jitdump_path,
)

UID = os.geteuid()
ORDERS = pytest.mark.parametrize("order", ["<", ">"], ids=["little", "big"])


class Writer:
    """Builds jitdump bytes the way runtimes write them."""

    def __init__(self, order: str = "<", pid: int = 4242) -> None:
        self.o = order
        self.pid = pid
        self.ts = 1_000

    def header(self, *, magic: int = JITDUMP_MAGIC, version: int = 1, size: int = 40) -> bytes:
        head = struct.pack(
            self.o + "IIIIIIQQ", magic, version, size, 62, 0xDEADBEEF, self.pid, 123456789, 0
        )
        return head + b"\0" * (size - 40)

    def record(self, rec_id: int, payload: bytes, total: int | None = None) -> bytes:
        self.ts += 1
        size = 16 + len(payload) if total is None else total
        return struct.pack(self.o + "IIQ", rec_id, size, self.ts) + payload

    def load(self, addr: int, size: int, name: str | bytes, index: int) -> bytes:
        raw = name.encode() if isinstance(name, str) else name
        fixed = struct.pack(self.o + "IIQQQQ", self.pid, self.pid + 1, addr, addr, size, index)
        return self.record(CODE_LOAD, fixed + raw + b"\0" + b"\xcc" * size)

    def move(self, old: int, new: int, size: int, index: int) -> bytes:
        fixed = struct.pack(self.o + "IIQQQQQ", self.pid, self.pid, new, old, new, size, index)
        return self.record(CODE_MOVE, fixed)

    def debug(self, code_addr: int, entries: list[tuple[int, int, str]]) -> bytes:
        body = struct.pack(self.o + "QQ", code_addr, len(entries))
        for addr, line, file in entries:
            body += struct.pack(self.o + "QII", addr, line, 0) + file.encode() + b"\0"
        return self.record(DEBUG_INFO, body)

    def unwind(self, eh_frame: bytes, hdr: bytes, mapped: int | None = None) -> bytes:
        data = eh_frame + hdr
        pad = b"\0" * (-len(data) % 8)
        fixed = struct.pack(
            self.o + "QQQ", len(data), len(hdr), len(data) if mapped is None else mapped
        )
        return self.record(UNWINDING_INFO, fixed + data + pad)

    def close(self) -> bytes:
        return self.record(CODE_CLOSE, b"")


EH_FRAME = b"\x14\x00\x00\x00\x00\x00\x00\x00\x01zR\x00\x01x\x10\x01\x1b\x0c\x07\x08\x90\x01"
EH_HDR = b"\x01\x1b\x03\x3b" + b"\0" * 16


def full_stream(w: Writer) -> bytes:
    return b"".join(
        [
            w.header(),
            w.debug(0x1000, [(0x1010, 12, "a.py"), (0x1000, 10, "a.py"), (0x1030, 20, "b.py")]),
            w.unwind(EH_FRAME, EH_HDR),
            w.load(0x1000, 0x40, "py::first:/src/a.py", 1),
            w.load(0x2000, 0x20, "py::second:/src/a b.py", 2),
            w.record(99, b"future record type payload"),
            w.move(0x2000, 0x3000, 0x20, 2),
            w.close(),
        ]
    )


@pytest.fixture
def dump(tmp_path: Path) -> Path:
    return tmp_path / "jit-4242.dump"


@ORDERS
def test_all_record_types(dump: Path, order: str) -> None:
    dump.write_bytes(full_stream(Writer(order)))
    jd = JitDump(str(dump), UID)
    r = jd.refresh()
    assert r.refused is None and r.remaining == 0
    assert jd.corrupt_reason is None
    assert jd.header is not None
    assert (jd.header.big_endian, jd.header.pid, jd.header.elf_mach) == (order == ">", 4242, 62)
    s = jd.stats
    assert (s.records, s.code_loads, s.code_moves, s.debug_infos, s.unwind_infos) == (7, 2, 1, 1, 1)
    assert (s.closes, s.unknown_records, s.bad_records, s.corrupt) == (1, 1, 0, 0)
    assert jd.closed

    assert jd.lookup(0x1000) == "py::first:/src/a.py"
    assert jd.lookup(0x103F) == "py::first:/src/a.py"
    assert jd.lookup(0x1040) is None
    # DEBUG_INFO attached to the load of its code_addr, sorted by address.
    assert jd.debug_info(0x1000) == ("a.py", 10)
    assert jd.debug_info(0x1015) == ("a.py", 12)
    assert jd.debug_info(0x103F) == ("b.py", 20)
    # UNWINDING_INFO attached to the next load only.
    assert jd.unwind_info(0x1000) == EH_FRAME
    entry = jd.entry(0x1000)
    assert entry is not None and entry.unwind is not None
    assert entry.unwind.eh_frame_hdr == EH_HDR
    assert entry.unwind.mapped_size == len(EH_FRAME) + len(EH_HDR)
    assert not hasattr(entry, "code")  # machine code is never kept

    # CODE_MOVE: the code left 0x2000 and lives at 0x3000 now.
    assert jd.lookup(0x2000) is None
    assert jd.lookup(0x3000) == "py::second:/src/a b.py"
    assert jd.unwind_info(0x3000) is None
    assert jd.debug_info(0x3000) is None
    moved = jd.entry(0x301F)
    assert moved is not None and (moved.code_addr, moved.code_size, moved.code_index) == (
        0x3000,
        0x20,
        2,
    )
    assert len(jd) == 2
    assert s.entries == 2


def test_both_byte_orders_agree(tmp_path: Path) -> None:
    results = []
    for order in "<>":
        path = tmp_path / f"jit-{ord(order)}.dump"
        path.write_bytes(full_stream(Writer(order)))
        jd = JitDump(str(path), UID)
        jd.refresh()
        results.append([(s, e, c.name, c.debug is not None) for s, e, c in jd.symbols()])
    assert results[0] == results[1]


def test_debug_info_moves_with_its_code(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(
        w.header()
        + w.debug(0x1000, [(0x1000, 5, "f.js"), (0x1008, 6, "f.js")])
        + w.load(0x1000, 0x10, "f", 7)
        + w.move(0x1000, 0x9000, 0x10, 7)
    )
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.debug_info(0x9009) == ("f.js", 6)
    assert jd.lookup(0x1000) is None


def test_debug_info_for_other_code_is_not_attached(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(
        w.header()
        + w.debug(0x5000, [(0x5000, 1, "other.py")])
        + w.load(0x1000, 0x10, "f", 1)
        + w.load(0x5000, 0x10, "g", 2)
    )
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.debug_info(0x1000) is None
    assert jd.debug_info(0x5000) == ("other.py", 1)


def test_debug_lines_outside_the_code_are_dropped(dump: Path) -> None:
    """V8 (node 20) writes some entries with garbage addresses."""
    w = Writer()
    dump.write_bytes(
        w.header()
        + w.debug(0x1000, [(0x1004, 3, "ok.js"), (0xCD560E8600000000, 99, "s"), (0x10, 1, "x")])
        + w.load(0x1000, 0x10, "f", 1)
    )
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.debug_info(0x100F) == ("ok.js", 3)
    assert jd.stats.debug_lines_dropped == 2


def test_newest_load_wins(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(
        w.header() + w.load(0x1000, 0x100, "old", 1) + w.load(0x1080, 0x10, "new", 2)
    )
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.lookup(0x1000) == "old"
    assert jd.lookup(0x1085) == "new"
    assert jd.lookup(0x1090) == "old"


def test_unknown_move_is_a_bad_record(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(w.header() + w.load(0x1000, 0x10, "f", 1) + w.move(0x7000, 0x8000, 0x10, 9))
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.stats.bad_records == 1
    assert jd.lookup(0x8000) is None
    assert jd.lookup(0x1000) == "f"


# -- incremental reading ---------------------------------------------------


@ORDERS
def test_truncated_last_record_completes_on_next_refresh(dump: Path, order: str) -> None:
    w = Writer(order)
    first = w.header() + w.load(0x1000, 0x10, "first", 1)
    second = w.load(0x2000, 0x10, "second", 2)
    dump.write_bytes(first + second[:30])  # writer stopped mid-record
    jd = JitDump(str(dump), UID)
    r = jd.refresh()
    assert r.new_entries == 1
    assert r.remaining == 30
    assert jd.lookup(0x2000) is None
    assert jd.stats.corrupt == 0 and jd.stats.bad_records == 0

    with open(dump, "ab") as fh:
        fh.write(second[30:])
    r = jd.refresh()
    assert r.new_entries == 1
    assert r.bytes_read == len(second)  # the partial record is read again, whole
    assert r.remaining == 0
    assert jd.lookup(0x2000) == "second"
    assert jd.lookup(0x1000) == "first"


def test_truncated_header_waits(dump: Path) -> None:
    w = Writer()
    data = w.header() + w.load(0x1000, 0x10, "f", 1)
    dump.write_bytes(data[:20])
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.header is None and jd.corrupt_reason is None
    with open(dump, "ab") as fh:
        fh.write(data[20:])
    jd.refresh()
    assert jd.lookup(0x1000) == "f"


def test_appends_are_read_incrementally(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(w.header())
    jd = JitDump(str(dump), UID)
    jd.refresh()
    total = 40
    for i in range(20):
        rec = w.load(0x1000 + i * 0x100, 0x10, f"f{i}", i)
        with open(dump, "ab") as fh:
            fh.write(rec)
        r = jd.refresh()
        assert r.bytes_read == len(rec)
        total += len(rec)
    assert jd.stats.bytes_read == total
    assert jd.lookup(0x1000 + 19 * 0x100) == "f19"


def test_record_larger_than_a_chunk(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(w.header() + w.load(0x1000, 300_000, "huge", 1) + w.load(0x900000, 16, "g", 2))
    jd = JitDump(str(dump), UID, chunk_bytes=4096)
    jd.refresh()
    assert jd.lookup(0x1000 + 299_999) == "huge"
    assert jd.lookup(0x900000) == "g"


def test_replacement_reloads(dump: Path, tmp_path: Path) -> None:
    w = Writer()
    dump.write_bytes(w.header() + w.load(0x1000, 0x10, "old", 1))
    jd = JitDump(str(dump), UID)
    jd.refresh()
    fresh = tmp_path / "fresh"
    fresh.write_bytes(w.header() + w.load(0x2000, 0x10, "new", 1))
    os.rename(fresh, dump)
    r = jd.refresh()
    assert r.reloaded
    assert jd.lookup(0x1000) is None
    assert jd.lookup(0x2000) == "new"


# -- damage ----------------------------------------------------------------


@pytest.mark.parametrize("bad_size", [0, 15, 1 << 30])
def test_bad_record_size_stops_parsing(dump: Path, bad_size: int) -> None:
    w = Writer()
    good = w.header() + w.load(0x1000, 0x10, "before", 1)
    dump.write_bytes(good + w.record(CODE_LOAD, b"x" * 64, total=bad_size) + b"\0" * 64)
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.corrupt_reason == "bad_record_size"
    assert jd.stats.corrupt == 1
    assert jd.lookup(0x1000) == "before"
    with open(dump, "ab") as fh:
        fh.write(w.load(0x2000, 0x10, "after", 2))
    r = jd.refresh()
    assert r.bytes_read == 0  # not read again, not counted again
    assert jd.stats.corrupt == 1
    assert jd.lookup(0x2000) is None


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        (b"JUNK" + b"\0" * 36, "bad_magic"),
        (Writer().header(version=2), "bad_version"),
        (Writer().header(size=39)[:40], "bad_header_size"),
        (Writer().header(size=40)[:8] + struct.pack("<I", 1 << 20) + b"\0" * 28, "bad_header_size"),
    ],
)
def test_bad_header(dump: Path, header: bytes, reason: str) -> None:
    dump.write_bytes(header + Writer().load(0x1000, 0x10, "f", 1))
    jd = JitDump(str(dump), UID)
    r = jd.refresh()
    assert r.refused is None
    assert jd.corrupt_reason == reason
    assert jd.stats.corrupt == 1
    assert jd.lookup(0x1000) is None


def test_longer_header_is_skipped(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(w.header(size=64) + w.load(0x1000, 0x10, "f", 1))
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.header is not None and jd.header.header_size == 64
    assert jd.lookup(0x1000) == "f"


def test_inconsistent_records_are_skipped(dump: Path) -> None:
    w = Writer()
    o = w.o
    no_nul = struct.pack(o + "IIQQQQ", 1, 1, 0x5000, 0x5000, 4, 9) + b"name-without-nul"
    code_too_long = struct.pack(o + "IIQQQQ", 1, 1, 0x6000, 0x6000, 1000, 9) + b"n\0" + b"\xcc" * 4
    short_load = b"\0" * 20
    debug_overrun = struct.pack(o + "QQ", 0x1000, 1_000_000) + struct.pack(o + "QII", 0x1000, 1, 0)
    unwind_overrun = struct.pack(o + "QQQ", 4096, 16, 4096) + b"\0" * 32
    unwind_hdr_gt = struct.pack(o + "QQQ", 8, 16, 8) + b"\0" * 8
    dump.write_bytes(
        w.header()
        + w.record(CODE_LOAD, no_nul)
        + w.record(CODE_LOAD, code_too_long)
        + w.record(CODE_LOAD, short_load)
        + w.record(CODE_MOVE, b"\0" * 8)
        + w.record(DEBUG_INFO, debug_overrun)
        + w.record(UNWINDING_INFO, unwind_overrun)
        + w.record(UNWINDING_INFO, unwind_hdr_gt)
        + w.load(0x1000, 0x10, "still fine", 1)
    )
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.stats.bad_records == 7
    assert jd.stats.corrupt == 0
    assert jd.lookup(0x1000) == "still fine"
    assert jd.lookup(0x5000) is None and jd.lookup(0x6000) is None
    assert jd.unwind_info(0x1000) is None


def test_zero_size_code_is_ignored(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(w.header() + w.load(0x1000, 0, "empty", 1))
    jd = JitDump(str(dump), UID)
    jd.refresh()
    assert jd.lookup(0x1000) is None
    assert jd.stats.bad_records == 0


def test_caps(dump: Path) -> None:
    w = Writer()
    dump.write_bytes(
        w.header()
        + w.unwind(b"\x01" * 5000, EH_HDR)
        + w.load(0x1000, 0x10, "big unwind", 1)
        + w.debug(0x2000, [(0x2000 + i, i, "f") for i in range(10)])
        + w.load(0x2000, 0x10, "many lines", 2)
        + b"".join(w.load(0x10000 + i * 0x10, 0x10, f"f{i}", 10 + i) for i in range(10))
    )
    jd = JitDump(str(dump), UID, max_unwind_bytes=1024, max_debug_lines=4, max_entries=5)
    jd.refresh()
    assert jd.stats.unwind_dropped == 1
    assert jd.unwind_info(0x1000) is None
    assert jd.stats.debug_lines_dropped == 6
    assert jd.debug_info(0x2009) == ("f", 3)
    assert jd.stats.dropped_entries == 7
    assert len(jd) == 5


def test_file_cap(dump: Path) -> None:
    w = Writer()
    data = w.header() + b"".join(w.load(0x1000 + i * 0x10, 0x10, f"f{i}", i) for i in range(100))
    dump.write_bytes(data)
    jd = JitDump(str(dump), UID, max_file_bytes=1000)
    r = jd.refresh()
    assert r.capped
    assert jd.stats.bytes_read <= 1000
    assert jd.stats.bytes_capped == len(data) - 1000
    assert 0 < len(jd) < 100


def test_hostile_paths(tmp_path: Path, dump: Path) -> None:
    real = tmp_path / "real.dump"
    real.write_bytes(Writer().header())
    dump.symlink_to(real)
    assert JitDump(str(dump), UID).refresh().refused == "symlink"
    fifo = tmp_path / "jit-1.dump"
    os.mkfifo(fifo)
    t0 = time.monotonic()
    assert JitDump(str(fifo), UID).refresh().refused == "not_regular"
    assert time.monotonic() - t0 < 1.0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_foreign_owner(dump: Path) -> None:
    dump.write_bytes(Writer().header() + Writer().load(0x1000, 0x10, "f", 1))
    os.chown(dump, 12345, 12345)
    jd = JitDump(str(dump), 1000)
    assert jd.refresh().refused == "foreign_owner"
    assert jd.lookup(0x1000) is None


def test_jitdump_path(tmp_path: Path) -> None:
    assert jitdump_path(10, 3) == "/proc/10/root/tmp/jit-3.dump"
    root = tmp_path / "proc" / "10" / "root" / "tmp"
    root.mkdir(parents=True)
    (root / "jit-3.dump").write_bytes(Writer().header() + Writer().load(0x1000, 0x10, "c", 1))
    jd = JitDump.for_process(10, 3, UID, proc_root=str(tmp_path / "proc"))
    jd.refresh()
    assert jd.lookup(0x1000) == "c"


# -- a real writer ---------------------------------------------------------


def test_node_perf_prof_jitdump(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: no real jitdump writer to test against")
    if platform.machine() != "x86_64":
        pytest.skip("V8 emits unwinding info for jitdump on x86-64 only")
    script = tmp_path / "spin.js"
    script.write_text(
        "function spin(ms){const end=Date.now()+ms;let x=0;"
        "while(Date.now()<end){x+=Math.sqrt(x+1);}return x;}\nspin(1000);\n"
    )
    # V8 writes jit-<pid>.dump into the current directory.
    proc = subprocess.run(
        [node, "--perf-prof", "--perf-prof-unwinding-info", str(script)],
        cwd=tmp_path,
        capture_output=True,
        timeout=60,
        check=True,
    )
    assert proc.returncode == 0
    dumps = list(tmp_path.glob("jit-*.dump"))
    assert len(dumps) == 1
    jd = JitDump(str(dumps[0]), UID)
    r = jd.refresh()
    assert r.refused is None and r.remaining == 0
    assert jd.corrupt_reason is None
    assert jd.header is not None and jd.header.elf_mach == 62 and not jd.header.big_endian
    assert jd.stats.code_loads > 100 and jd.stats.bad_records == 0
    spins = [(s, e, c) for s, e, c in jd.symbols() if c.name.split(" ", 1)[0].endswith("spin")]
    assert spins, "V8 wrote no CODE_LOAD for spin()"
    for start, _end, code in spins:
        assert jd.lookup(start) == code.name
        assert code.unwind is not None  # --perf-prof-unwinding-info precedes every load
    # Optimised code carries a real .eh_frame: it starts with a CIE (id 0)
    # whose length fits the data.
    frames = [jd.unwind_info(s) for s, _, _ in spins]
    real = [f for f in frames if f]
    assert real, "no eh_frame for optimised spin()"
    for eh_frame in real:
        length, cie_id = struct.unpack_from("<II", eh_frame, 0)
        assert cie_id == 0 and 4 + length <= len(eh_frame)


def test_memory_estimate_matches_what_the_index_really_holds(tmp_path: Path) -> None:
    """The symbol memory budget counts memory_bytes(); it must be close to what
    tracemalloc sees the reader hold (within 25%)."""
    from tramprof.symbols.names import SHARED_NAMES

    from .traced import traced_bytes

    w = Writer()
    n = 20_000
    path = tmp_path / "jit-4242.dump"
    with open(path, "wb") as f:
        f.write(w.header())
        for i in range(n):
            f.write(w.load(0x100000 + i * 64, 48, f"py::function_{i}:/srv/app/mod_{i % 50}.py",
                           i))
    def build() -> JitDump:
        reader = JitDump(str(path), UID)
        reader.refresh()
        assert reader.entry(0x100000 + 5 * 64) is not None  # the index is built
        return reader

    # The table sharing names between processes is bounded on its own
    # (symbols.names), not by the readers' estimates: left out here.
    SHARED_NAMES.clear()
    reader, held = traced_bytes(lambda: (build(), SHARED_NAMES.clear())[0])
    assert len(reader) == n
    estimate = reader.memory_bytes()
    assert 0.75 * held <= estimate <= 1.25 * held, (estimate, held)


def test_processes_running_the_same_code_share_names_and_files(tmp_path: Path) -> None:
    """Names and debug-info file names of the same code in two processes are
    held once."""
    readers = []
    for pid, base in ((4242, 0x1000), (4243, 0x7F0000)):
        w = Writer(pid=pid)
        path = tmp_path / f"jit-{pid}.dump"
        path.write_bytes(w.header() + w.debug(base, [(base, 5, "/srv/app/f.js")])
                         + w.load(base, 0x10, "JS:*handle /srv/app/f.js:5", 1))
        reader = JitDump(str(path), UID)
        reader.refresh()
        readers.append((reader, base))
    (first, first_base), (second, second_base) = readers
    name = first.lookup(first_base + 4)
    assert name == "JS:*handle /srv/app/f.js:5"
    assert second.lookup(second_base + 4) is name
    first_file, second_file = first.debug_info(first_base), second.debug_info(second_base)
    assert first_file == ("/srv/app/f.js", 5) and second_file is not None
    assert second_file[0] is first_file[0]
