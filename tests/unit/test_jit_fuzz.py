"""Property tests: arbitrary file contents never break the readers or their
caps, reading in pieces gives the same result as reading at once, and the
address index always agrees with a brute-force newest-wins model."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tramprof.symbols import addrindex
from tramprof.symbols.addrindex import AddrIndex
from tramprof.symbols.jitdump import JITDUMP_MAGIC, JitDump
from tramprof.symbols.perfmap import PerfMap

UID = os.geteuid()
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@contextmanager
def scratch_file(name: str) -> Iterator[Path]:
    d = tempfile.mkdtemp(prefix="tramprof-fuzz-")
    try:
        yield Path(d) / name
    finally:
        shutil.rmtree(d)


def probe_addresses(extra: list[int]) -> list[int]:
    base = [0, 1, 0x1000, 0x1FFF, 0x7F0000000000, (1 << 64) - 1, 1 << 64]
    return base + extra


# -- perf map ----------------------------------------------------------------

HEX = st.integers(0, (1 << 64) - 1).map(lambda v: b"%x" % v)
SMALL_HEX = st.integers(0, 0x3000).map(lambda v: b"%x" % v)
NAME = st.binary(min_size=0, max_size=40)
LINE = st.one_of(
    st.tuples(
        st.sampled_from([b"", b" ", b"\t", b"0x"]),
        st.one_of(SMALL_HEX, HEX),
        st.sampled_from([b" ", b"\t", b"  ", b" 0x", b""]),
        st.one_of(SMALL_HEX, st.integers(0, 0x200).map(lambda v: b"%X" % v)),
        st.sampled_from([b" ", b"\t", b""]),
        NAME,
        st.sampled_from([b"\n", b"\r\n", b"\n\n", b""]),
    ).map(b"".join),
    st.binary(max_size=120),
    st.just(b"\n"),
)
# Well-formed lines (overlapping a lot) so that most examples have entries.
VALID_LINE = st.tuples(
    st.integers(0, 0x40).map(lambda v: v * 0x40),
    st.integers(1, 0x200),
    st.text(st.characters(blacklist_categories=["Cc", "Cs"]), min_size=1, max_size=30),
).map(lambda t: b"%x %x %s\n" % (t[0], t[1], t[2].strip().encode() or b"_"))
MAP_CONTENT = st.lists(st.one_of(VALID_LINE, VALID_LINE, LINE), max_size=40).map(b"".join)
ANY_BYTES = st.one_of(st.binary(max_size=4000), MAP_CONTENT)

PM_CAPS = {"max_file_bytes": 2048, "max_line_bytes": 64, "max_entries": 20}


@FUZZ
@given(content=ANY_BYTES, probes=st.lists(st.integers(0, (1 << 65)), max_size=20))
def test_perfmap_never_raises_and_respects_caps(content: bytes, probes: list[int]) -> None:
    with scratch_file("perf-1.map") as path:
        path.write_bytes(content)
        pm = PerfMap(str(path), UID, **PM_CAPS)
        r = pm.refresh()
        assert r.refused is None
        assert r.bytes_read <= PM_CAPS["max_file_bytes"]
        assert r.capped == (len(content) > PM_CAPS["max_file_bytes"])
        assert pm.stats.entries <= PM_CAPS["max_entries"]
        assert pm.stats.lines_parsed <= PM_CAPS["max_entries"]
        for _start, _end, name in pm.symbols():
            assert len(name.encode("utf-8", "surrogatepass")) <= 4 * PM_CAPS["max_line_bytes"]
            assert "\0" not in name and "\n" not in name
        for addr in probe_addresses(probes):
            found = pm.lookup(addr)
            assert found is None or isinstance(found, str)
        assert pm.refresh().bytes_read == 0


@FUZZ
@given(
    content=MAP_CONTENT,
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
def test_perfmap_incremental_equals_one_shot(content: bytes, cuts: list[int]) -> None:
    caps = {"max_line_bytes": 64, "max_entries": 25, "chunk_bytes": 200}
    with scratch_file("perf-2.map") as path:
        path.write_bytes(content)
        whole = PerfMap(str(path), UID, **caps)
        whole.refresh()

        path.write_bytes(b"")
        piecewise = PerfMap(str(path), UID, **caps)
        piecewise.refresh()
        points = sorted({min(c, len(content)) for c in cuts} | {len(content)})
        done = 0
        for point in points:
            with open(path, "ab") as fh:
                fh.write(content[done:point])
            done = point
            piecewise.refresh()
        assert piecewise.symbols() == whole.symbols()
        for field in ("lines_parsed", "malformed", "long_lines", "dropped_entries", "entries"):
            assert getattr(piecewise.stats, field) == getattr(whole.stats, field), field


# -- jitdump -----------------------------------------------------------------


def header(order: str) -> bytes:
    return struct.pack(order + "IIIIIIQQ", JITDUMP_MAGIC, 1, 40, 62, 0, 7, 0, 0)


def record(order: str, rec_id: int, payload: bytes) -> bytes:
    return struct.pack(order + "IIQ", rec_id, 16 + len(payload), 0) + payload


# Few distinct addresses and indexes, so that moves and debug info often
# refer to code that was loaded.
ADDR = st.one_of(st.sampled_from([0x1000, 0x1100, 0x2000, 0x2040]), st.integers(0, 0x4000))
INDEX = st.integers(0, 3)


@st.composite
def jit_records(draw: st.DrawFn, order: str) -> bytes:
    kind = draw(st.sampled_from(["load", "move", "debug", "unwind", "close", "unknown"]))
    if kind == "load":
        addr, size, index = draw(ADDR), draw(st.integers(0, 0x300)), draw(INDEX)
        name = draw(st.binary(max_size=20).map(lambda b: b.replace(b"\0", b"")))
        fixed = struct.pack(order + "IIQQQQ", 7, 7, addr, addr, size, index)
        return record(order, 0, fixed + name + b"\0" + b"\xcc" * size)
    if kind == "move":
        old, new, size, index = draw(ADDR), draw(ADDR), draw(st.integers(0, 0x300)), draw(INDEX)
        return record(order, 1, struct.pack(order + "IIQQQQQ", 7, 7, new, old, new, size, index))
    if kind == "debug":
        code = draw(ADDR)
        entries = draw(st.lists(st.tuples(ADDR, st.integers(0, (1 << 32) - 1)), max_size=5))
        body = struct.pack(order + "QQ", code, len(entries))
        for addr, line in entries:
            body += struct.pack(order + "QII", addr, line, 0) + b"f.py\0"
        return record(order, 2, body)
    if kind == "unwind":
        data = draw(st.binary(max_size=96))
        hdr = draw(st.integers(0, len(data)))
        return record(order, 4, struct.pack(order + "QQQ", len(data), hdr, len(data)) + data)
    if kind == "close":
        return record(order, 3, b"")
    return record(order, draw(st.integers(5, (1 << 32) - 1)), draw(st.binary(max_size=30)))


@st.composite
def jit_streams(draw: st.DrawFn) -> bytes:
    order = draw(st.sampled_from(["<", ">"]))
    recs = draw(st.lists(jit_records(order), max_size=25))
    return header(order) + b"".join(recs)


JIT_CAPS = {
    "max_file_bytes": 8192,
    "max_record_bytes": 1024,
    "max_entries": 12,
    "max_unwind_bytes": 64,
    "max_debug_lines": 16,
}
JIT_BYTES = st.one_of(
    st.binary(max_size=3000),
    st.tuples(st.sampled_from([header("<"), header(">")]), st.binary(max_size=3000)).map(
        b"".join
    ),
    jit_streams(),
    st.tuples(jit_streams(), st.binary(max_size=200)).map(b"".join),
)


def jit_view(jd: JitDump) -> list[tuple[int, int, str, int, int]]:
    return [(s, e, c.name, c.code_addr, c.code_index) for s, e, c in jd.symbols()]


@FUZZ
@given(content=JIT_BYTES, probes=st.lists(st.integers(0, 1 << 65), max_size=20))
def test_jitdump_never_raises_and_respects_caps(content: bytes, probes: list[int]) -> None:
    with scratch_file("jit-1.dump") as path:
        path.write_bytes(content)
        jd = JitDump(str(path), UID, **JIT_CAPS)
        r = jd.refresh()
        assert r.refused is None
        assert jd.stats.bytes_read <= JIT_CAPS["max_file_bytes"]
        assert len(jd) <= JIT_CAPS["max_entries"]
        for addr in probe_addresses(probes) + [s for s, _, _ in jd.symbols()]:
            name = jd.lookup(addr)
            assert name is None or isinstance(name, str)
            info = jd.debug_info(addr)
            assert info is None or (isinstance(info[0], str) and isinstance(info[1], int))
            eh = jd.unwind_info(addr)
            assert eh is None or len(eh) <= JIT_CAPS["max_unwind_bytes"]
        jd.refresh()


@FUZZ
@given(content=jit_streams(), cuts=st.lists(st.integers(0, 6000), max_size=6))
def test_jitdump_incremental_equals_one_shot(content: bytes, cuts: list[int]) -> None:
    caps = {"max_entries": 30, "chunk_bytes": 64}
    with scratch_file("jit-2.dump") as path:
        path.write_bytes(content)
        whole = JitDump(str(path), UID, **caps)
        whole.refresh()

        path.write_bytes(b"")
        piecewise = JitDump(str(path), UID, **caps)
        piecewise.refresh()
        done = 0
        for point in sorted({min(c, len(content)) for c in cuts} | {len(content)}):
            with open(path, "ab") as fh:
                fh.write(content[done:point])
            done = point
            piecewise.refresh()
        assert jit_view(piecewise) == jit_view(whole)
        assert piecewise.stats.as_dict() | {"bytes_read": 0} == whole.stats.as_dict() | {
            "bytes_read": 0
        }


# -- the index ---------------------------------------------------------------

RANGE = st.tuples(st.integers(0, 300), st.integers(1, 80), st.booleans())


@settings(max_examples=300, deadline=None)
@given(
    batches=st.lists(st.lists(RANGE, max_size=30), min_size=1, max_size=6),
    tiny_overlay=st.booleans(),
)
def test_addrindex_matches_newest_wins_model(
    batches: list[list[tuple[int, int, bool]]], tiny_overlay: bool
) -> None:
    # A tiny overlay limit makes every batch exercise the merge into the base.
    with mock.patch.object(addrindex, "_OVERLAY_MIN", 4 if tiny_overlay else 4096):
        check_index_against_model(batches)


def check_index_against_model(batches: list[list[tuple[int, int, bool]]]) -> None:
    """Lookups as the model answers them, and the same answer as before the
    batch wherever ``take_changes`` does not name a range."""
    index: AddrIndex[int] = AddrIndex()
    model: list[tuple[int, int, int | None]] = []
    before: list[int | None] = [None] * 400
    assert index.take_changes() is None  # new: nothing is known of what came before
    for batch in batches:
        for start, size, tombstone in batch:
            value = None if tombstone else len(model)
            assert index.add(start, start + size, value)
            model.append((start, start + size, value))
        changes = index.take_changes()
        assert changes == [(start, start + size) for start, size, _tombstone in batch]
        for addr in range(0, 400):
            expected = None
            for s, e, v in model:
                if s <= addr < e:
                    expected = v
            assert index.lookup(addr) == expected, addr
            if not any(s <= addr < e for s, e in changes):
                assert expected == before[addr], addr
            before[addr] = expected
    items = index.items()
    assert all(s < e for s, e, _ in items)
    assert all(a[1] <= b[0] for a, b in pairwise(items))


def test_addrindex_changes_are_told_in_batches_and_bounded() -> None:
    """A batch's ranges as added; after a clear, or past ``MAX_CHANGES``
    ranges, "anything may have changed" (None), never a partial list."""
    index: AddrIndex[str] = AddrIndex()
    index.take_changes()
    index.extend(array("Q", [0x10, 0x40]), array("Q", [0x20, 0x48]), ["a", "b"])
    index.add(0x18, 0x30, None)
    assert index.take_changes() == [(0x10, 0x20), (0x40, 0x48), (0x18, 0x30)]
    assert index.take_changes() == []
    assert not index.add(0x30, 0x30, "empty")  # refused: nothing changed
    assert index.take_changes() == []
    index.clear()
    assert index.take_changes() is None
    many = addrindex.MAX_CHANGES + 1
    index.extend(array("Q", range(0, 2 * many, 2)), array("Q", range(1, 2 * many, 2)),
                 ["x"] * many)
    assert index.take_changes() is None
    index.add(1, 2, "y")
    assert index.take_changes() == [(1, 2)]
