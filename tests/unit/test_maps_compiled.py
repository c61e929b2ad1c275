"""The compiled parse of /proc/PID/maps (tramprof._speedups.parse_maps)
against the Python parse it stands for: the same mappings, or the same error,
for every text, kernel lines and odd ones alike (a process chooses its file
names, and a fixture or a broken mount can give any text); and no reference
kept past a call."""

from __future__ import annotations

import glob
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tramprof import speedups
from tramprof.procfs.maps import Mapping, parse_maps

from .compiled import _speedups, needs_speedups
from .traced import traced_bytes

pytestmark = needs_speedups


def parsed(data: bytes, compiled: object) -> tuple[str, object]:
    """parse_maps's result (or its error) with the compiled part on or off."""
    saved = speedups.compiled
    speedups.compiled = compiled  # type: ignore[assignment]
    try:
        mappings = parse_maps(data)
    except Exception as exc:  # the same error is what is compared
        return "error", (type(exc), str(exc))
    finally:
        speedups.compiled = saved
    return "ok", [(type(m), tuple(map(type, m)), m) for m in mappings]


def assert_same(data: bytes) -> None:
    assert parsed(data, _speedups) == parsed(data, None)


def live_maps() -> Iterator[bytes]:
    for path in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if data:
            yield data


def test_every_live_maps_file_is_parsed_in_c_as_in_python() -> None:
    """Every process's maps on this machine: all kernel lines, so the compiled
    parse takes each whole (never handing it back) and agrees."""
    texts = list(live_maps())
    assert len(texts) >= 3  # this process, its parent, init at least
    for data in texts:
        assert _speedups.parse_maps(data, Mapping) is not None
        assert_same(data)


KERNEL = b"7f0000010000-7f0000020000 r-xp 00001000 fe:00 999"


@pytest.mark.parametrize("data", [
    b"",
    KERNEL + b"\n",
    KERNEL,                                     # no final newline
    KERNEL + b"      /usr/lib/libc.so.6\n",
    KERNEL + b" /a b\r\x0b\x85 (deleted)\n",      # a name with \r, \v, NEL: one line
    KERNEL + b" /\xff\xfe\n",                   # not UTF-8: surrogate escapes
    KERNEL + b"   \n",                          # padding only: no path
    b"0000000000000000000000000001-0000000000000000000000000002 r-xp 0 0:0 0\n",
    b"1-2 r-xp 0 0:0 00000000000000000000000018446744073709551615\n",
])
def test_kernel_lines_are_taken_in_c(data: bytes) -> None:
    assert _speedups.parse_maps(data, Mapping) is not None
    assert_same(data)


@pytest.mark.parametrize("data", [
    KERNEL + b"\n\n" + KERNEL + b"\n",          # a blank line: Python skips it
    b"10000000000000000-10000000000000001 r-xp 0 0:0 0\n",   # above 2**64
    b"1-2 r-xp 0 0:0 18446744073709551616\n",   # inode above 2**64
    b"2-1 r-xp 0 0:0 0\n",                      # ends before it starts
    b"1-2 r\xc3\xa9p 0 0:0 0\n",                # permissions not ASCII
    b"1-2 r-xp 0 0:0 0\t/x\n",                  # a tab where a space goes
    b"1-2 r-xp 0 0:0 0x\n",
    b"1-2\tr-xp 0 0:0 0\n",
    b"1-2 r-xp 0 0:0 0\r\n",
    b"1-2 r-xp 0 0:0\n",
    b"1-2  r-xp 0 0:0 0\n",
    b"A-B r-xp 0 0:0 0\n",                      # uppercase hex
    b"  1-2 r-xp 0 0:0 0\n",
    b"garbage\n",
])
def test_other_lines_are_left_to_python(data: bytes) -> None:
    assert _speedups.parse_maps(data, Mapping) is None
    assert_same(data)


def test_the_type_must_be_a_tuple_subclass() -> None:
    with pytest.raises(TypeError):
        _speedups.parse_maps(KERNEL, dict)
    with pytest.raises(TypeError):
        _speedups.parse_maps(KERNEL.decode(), Mapping)


hex_text = st.one_of(
    st.integers(0, (1 << 64) - 1).map(lambda v: f"{v:x}"),
    st.integers(0, 1 << 70).map(lambda v: f"{v:x}"),
    st.integers(0, 1 << 64).map(lambda v: f"{v:016x}"),
    st.sampled_from(["", "0", "00", "g", "A", "7F", "-1", " 1"]),
)
decimal_text = st.one_of(st.integers(0, 1 << 66).map(str),
                         st.sampled_from(["", "0", "007", "1a", "+1", "-1"]))
perms_text = st.one_of(st.sampled_from(["r-xp", "r--p", "rw-s", "---p", "rwxp"]),
                       st.text(min_size=0, max_size=5))
padding = st.sampled_from([" ", "  ", " " * 26, "\t", "", " \t"])
path_bytes = st.one_of(
    st.sampled_from([b"", b"/usr/lib/libc.so.6", b"[vdso]", b"[anon:v8]", b"/x (deleted)",
                     b"/memfd:jit (deleted)"]),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b"")),
)


@st.composite
def maps_lines(draw: st.DrawFn) -> bytes:
    """A line near the kernel's format: each part right or slightly wrong."""
    fields = [draw(hex_text), "-", draw(hex_text), draw(st.sampled_from([" ", " ", "\t"])),
              draw(perms_text), " ", draw(hex_text), " ", draw(hex_text), ":", draw(hex_text),
              " ", draw(decimal_text)]
    line = "".join(fields).encode("utf-8", "surrogatepass")
    path = draw(path_bytes)
    if path or draw(st.booleans()):
        line += draw(padding).encode() + path
    return line


@settings(max_examples=3000, deadline=None)
@given(lines=st.lists(maps_lines(), max_size=6), separator=st.sampled_from([b"\n", b"\n\n"]),
       final=st.booleans())
def test_any_text_is_parsed_in_c_as_in_python(lines: list[bytes], separator: bytes,
                                              final: bool) -> None:
    assert_same(separator.join(lines) + (b"\n" if final and lines else b""))


def test_no_reference_is_kept_past_a_call() -> None:
    """Ten thousand parses of a 40-line file, and of one handed back at its
    last line, leave nothing behind."""
    good = b"".join(b"%x-%x r-xp %08x fe:01 %d /usr/lib/lib%d.so\n"
                    % (0x7F00_0000_0000 + i * 0x1000, 0x7F00_0000_1000 + i * 0x1000, i, i, i // 4)
                    for i in range(40))
    bad = good + b"1-2 r-xp 0 0:0 0x\n"

    def calls() -> None:
        for _ in range(10_000):
            assert _speedups.parse_maps(good, Mapping) is not None
            assert _speedups.parse_maps(bad, Mapping) is None

    calls()
    _, grown = traced_bytes(calls)
    assert grown < 64 * 1024
