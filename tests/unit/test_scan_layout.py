"""Scan-mode stub layout learnt from stub bytes (synthetic arenas)."""

from __future__ import annotations

import pytest
from tramprof.procfs.maps import Mapping
from tramprof.unwind.stub_layout import (
    CallerCheck,
    LayoutError,
    caller_offset,
    interpreter_text,
    learn_layout,
    return_offset,
    stride_from_addresses,
)

ENDBR = bytes.fromhex("f30f1efa")
STUB_312 = bytes.fromhex("4883ec08ffd14883c408c3")  # sub $8,%rsp; call *%rcx; add; ret
STUB_FP = bytes.fromhex("554889e5ffd15dc3")          # push %rbp; mov; call *%rcx; pop; ret
BASE = 0x7F0000000000


def arena(stub: bytes, stride: int, size: int = 0x10000) -> bytes:
    copy = stub + b"\x00" * (stride - len(stub))
    return copy * (size // stride)


@pytest.mark.parametrize(("stub", "offset"), [(ENDBR + STUB_312, 10), (STUB_312, 6),
                                               (ENDBR + STUB_FP, 10), (STUB_FP, 6)])
def test_layout_from_stub_bytes(stub: bytes, offset: int) -> None:
    data = arena(stub, 16)
    layout = learn_layout(stub, data, BASE, BASE + 32, [BASE, BASE + 16, BASE + 48])
    assert (layout.return_offset, layout.stride) == (offset, 16)
    # One named stub only: the stride comes from the period of the arena's bytes.
    assert learn_layout(stub, data, BASE, BASE, [BASE]).stride == 16


def test_wider_stride() -> None:
    stub = ENDBR + STUB_312 + b"\x90" * 8  # padding -> stride 32
    layout = learn_layout(stub, arena(stub, 32), BASE, BASE + 64, [BASE, BASE + 64])
    assert (layout.return_offset, layout.stride) == (10, 32)


def test_garbled_arena_is_refused() -> None:
    stub = ENDBR + STUB_312
    data = bytearray(arena(stub, 16))
    data[0x8000 + 3] ^= 0xFF  # one copy differs
    with pytest.raises(LayoutError) as exc:
        learn_layout(stub, bytes(data), BASE, BASE, [BASE, BASE + 16])
    assert exc.value.reason in ("arena_bytes", "stride_mismatch")


def test_stub_without_call_is_refused() -> None:
    stub = bytes.fromhex("f30f1efa4883ec084883c408c3")
    with pytest.raises(LayoutError) as exc:
        learn_layout(stub, arena(stub, 16), BASE, BASE, [BASE, BASE + 16])
    assert exc.value.reason == "no_call"


def test_misaligned_or_odd_stride_is_refused() -> None:
    stub = ENDBR + STUB_312
    with pytest.raises(LayoutError):  # stub not on the arena's grid
        learn_layout(stub, arena(stub, 16), BASE, BASE + 8, [BASE + 8, BASE + 24])
    odd = stub + b"\x90" * 9  # 24-byte stride: not a power of two
    data = (odd * (0x10000 // 24 + 1))[:0x10000]
    with pytest.raises(LayoutError):
        learn_layout(odd, data, BASE, BASE, [BASE, BASE + 24])


def test_helpers() -> None:
    assert return_offset(ENDBR + STUB_312) == 10
    assert stride_from_addresses([5, 5]) is None
    assert stride_from_addresses([0, 48, 16]) == 16


@pytest.mark.parametrize(("stub", "expected"), [
    (ENDBR + STUB_312, 16),                                # sub $8: padding, then the caller's
    (STUB_312, 16),
    (ENDBR + STUB_FP, 16),                                 # push %rbp: saved rbp, then the caller's
    (bytes.fromhex("4883ec18ffd14883c418c3"), 32),        # sub $24
    (bytes.fromhex("55ffd15dc3"), 16),
    (bytes.fromhex("4883ec04ffd1c3"), None),               # sub $4: not a whole word
    (bytes.fromhex("4881ec00010000ffd1c3"), None),         # sub $imm32: not modelled
    (bytes.fromhex("4889e0ffd1c3"), None),                 # mov %rsp,%rax: not modelled
])
def test_caller_offset_from_the_prologue(stub: bytes, expected: int | None) -> None:
    assert caller_offset(stub, return_offset(stub)) == expected
    if expected is not None:
        layout = learn_layout(stub, arena(stub, 16), BASE, BASE, [BASE, BASE + 16])
        assert layout.caller_offset == expected


def mapping(start: int, end: int, perms: str, inode: int, path: str) -> Mapping:
    return Mapping(start, end, perms, 0, 8, 1, inode, path)


def test_interpreter_text_prefers_libpython_then_the_executable() -> None:
    exe = [mapping(0x400000, 0x401000, "r--p", 11, "/usr/bin/python3.13"),
           mapping(0x401000, 0x700000, "r-xp", 11, "/usr/bin/python3.13"),
           mapping(0x7F0000000000, 0x7F0000100000, "r-xp", 12, "/usr/lib/libc.so.6"),
           mapping(0x7F0000200000, 0x7F0000210000, "rwxp", 0, "")]
    assert interpreter_text(exe, 11) == (0x401000, 0x700000)
    assert interpreter_text(exe, 99) is None  # the executable is not mapped: no check
    shared = [*exe, mapping(0x7F1000000000, 0x7F1000300000, "r-xp", 13,
                            "/usr/lib/libpython3.12.so.1.0")]
    assert interpreter_text(shared, 11) == (0x7F1000000000, 0x7F1000300000)
    two = [*shared, mapping(0x7F2000000000, 0x7F2000300000, "r-xp", 14,
                            "/opt/other/libpython3.11.so.1.0")]
    assert interpreter_text(two, 11) is None  # which one calls the stubs is unknown


@pytest.mark.parametrize(("offset", "phase"), [(16, 2), (32, 2), (8, 1), (24, 1), (12, 0)])
def test_word_phase_follows_the_aligned_call(offset: int, phase: int) -> None:
    # The caller calls the stub with rsp = 16n, so its own return address is at
    # 16n - 8 and the stub's `offset` bytes below that.
    check = CallerCheck(offset, 0x1000, 0x2000)
    assert check.word_phase == phase
    if phase:
        assert (0x7FFC0000 - 8 - offset) % 16 == (0 if phase == 1 else 8)
    assert not CallerCheck(offset, 0, 0).checks_text
