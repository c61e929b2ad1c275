"""Map types from bcc's JSON descriptions, and sysfs CPU lists, as the
daemon decodes them for a program loaded by the compiler child."""

from __future__ import annotations

import ctypes

import pytest
from tramprof.sampler.loaded import decode_type, parse_cpu_list


def test_scalars_are_bccs_ctypes():
    assert decode_type("unsigned long long") is ctypes.c_ulonglong
    assert decode_type("char") is ctypes.c_char
    assert ctypes.sizeof(decode_type("unsigned __int128")) == 16


def test_structs_with_arrays_bit_fields_and_anonymous_unions():
    desc = ["key_t", [
        ["pid", "unsigned int"],
        ["kind", "unsigned short", 4],
        ["flags", "unsigned short", 12],
        ["comm", "char", [16]],
        ["grid", "unsigned char", [2, 3]],
        ["", [["addr", "unsigned long long"], ["half", "unsigned int", [2]]], "union"],
    ], "struct"]
    key_t = decode_type(desc)
    assert key_t.__name__ == "key_t" and ctypes.sizeof(key_t) == 40
    key = key_t(pid=1, kind=3, flags=0xABC, comm=b"x")
    key.addr = 5 << 32  # the anonymous union's members are the struct's
    key.grid[1][2] = 7
    assert (key.kind, key.flags, key.half[1], key.grid[1][2]) == (3, 0xABC, 5, 7)


def test_packed_structs_have_no_padding():
    packed = decode_type(["p", [["a", "char"], ["b", "unsigned long long"]], "struct_packed"])
    padded = decode_type(["q", [["a", "char"], ["b", "unsigned long long"]], "struct"])
    assert (ctypes.sizeof(packed), ctypes.sizeof(padded)) == (9, 16)


@pytest.mark.parametrize(("desc", "message"), [
    ("no such type", "unknown scalar type 'no such type'"),
    (["s", [["a"]], "struct"], "malformed field"),
    (["s", [["a", "int", "enum"]], "struct"], "malformed field"),
    (["s", [["a", "int"]], "class"], "unknown aggregate kind 'class'"),
    (["s", "not a field list"], "malformed type description"),
    (42, "malformed type description"),
])
def test_malformed_descriptions_are_clear_errors(desc, message):
    with pytest.raises(ValueError, match=message):
        decode_type(desc)


def test_cpu_lists():
    assert parse_cpu_list("0-3,6\n") == [0, 1, 2, 3, 6]
    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("") == []
