"""Symbol names packed into one bytes object (symbols.names)."""

from __future__ import annotations

import pytest
from tramprof.symbols.names import NameSharer, PackedNames

NAMES = ["main", None, "_ZN4core3fmt5write17h", "naïve_λ", None, None,
         "bad\\xffbyte", "lone\udcffsurrogate", "vfs_read [kernel]"]


def test_every_name_and_gap_comes_back():
    packed = PackedNames(NAMES)
    assert len(packed) == len(NAMES)
    assert [packed[i] for i in range(len(NAMES))] == NAMES
    assert packed[-1] == NAMES[-1] and packed[-2] == NAMES[-2]
    assert packed.count() == sum(name is not None for name in NAMES)
    with pytest.raises(IndexError):
        packed[len(NAMES)]


def test_a_name_is_one_object_once_looked_up():
    packed = PackedNames(NAMES)
    assert packed[0] is packed[0]  # stacks that name it share it


def test_packed_is_smaller_than_a_list_of_str():
    import sys
    names = [f"some_function_name_{i}" for i in range(10_000)]
    as_list = sys.getsizeof(names) + sum(sys.getsizeof(n) for n in names)
    assert PackedNames(names).packed_bytes() < as_list / 2


def test_a_sharer_hands_out_one_object_per_name_and_stays_bounded() -> None:
    sharer = NameSharer(max_names=4)
    first = sharer.share(["".join(("a", str(i))) for i in range(3)])
    again = sharer.share(["".join(("a", str(i))) for i in range(3)])
    assert again == first and all(a is b for a, b in zip(again, first, strict=True))
    assert sharer.one("".join(("a", "1"))) is first[1]
    assert len(sharer) == 3
    # Past the bound it starts afresh: what it handed out stays valid.
    assert sharer.share(["b1", "b2"]) == ["b1", "b2"]
    assert len(sharer) == 0
    assert sharer.one("".join(("a", "1"))) is not first[1]
    assert first == ["a0", "a1", "a2"]
