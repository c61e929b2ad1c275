"""Unwind tables compiled in a child process: the same rows as in process,
and every failure of the child an error of that one object."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from tramprof.unwind.cfi import CfiError, compile_table
from tramprof.unwind.cfibuild import build_in_child, executable_segments

OBJECT = Path(sys.executable).resolve()


def test_the_child_compiles_what_the_daemon_would() -> None:
    with open(OBJECT, "rb") as f:
        table, segments = build_in_child(f)
    with open(OBJECT, "rb") as f:
        expected = compile_table(f)
        expected_segments = executable_segments(f)
    assert table.row_count == expected.row_count > 1000
    assert table.rows == expected.rows
    assert (table.fdes, table.fp_share, table.unsupported) == (
        expected.fdes, expected.fp_share, expected.unsupported)
    assert segments == expected_segments and segments


def test_a_file_that_is_not_elf_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x7fELF" + b"\xff" * 4096)
    with open(junk, "rb") as f, pytest.raises(CfiError):
        build_in_child(f)


def test_a_build_past_its_memory_limit_is_an_error_of_that_object() -> None:
    with open(OBJECT, "rb") as f, pytest.raises(CfiError, match=r"MiB|status"):
        build_in_child(f, address_space=48 << 20)


def test_a_build_past_its_time_limit_is_killed() -> None:
    with open(OBJECT, "rb") as f, pytest.raises(CfiError, match="more than 0 s"):
        build_in_child(f, timeout=0.01)
