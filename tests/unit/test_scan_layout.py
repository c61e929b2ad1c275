"""Scan-mode stub layout learnt from stub bytes (synthetic arenas)."""

from __future__ import annotations

import pytest
from tramprof.scan import LayoutError, learn_layout, return_offset, stride_from_addresses

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
