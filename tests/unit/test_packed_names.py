"""Symbol names packed into one bytes object (symbols.names)."""

from __future__ import annotations

import pytest
from tramprof.symbols.names import PackedNames

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
