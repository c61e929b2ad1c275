"""Reading other processes' memory through files held open between reads."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tramprof.procfs.memory import (
    MAX_READ_BYTES,
    MAX_WRITE_BYTES,
    MemoryReadError,
    OpenMemory,
    read_memory,
    write_memory,
)

# A page every child maps at the same address and fills with its first
# argument; with more, it execs itself (its code is in CHILD_CODE) with the rest.
ADDRESS = 0x7E0000000000
CHILD = f"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
MAP_PRIVATE_ANONYMOUS, MAP_FIXED_NOREPLACE = 0x22, 0x100000
page = libc.mmap({ADDRESS}, 4096, 3, MAP_PRIVATE_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
assert page == {ADDRESS}, ctypes.get_errno()
ctypes.memmove(page, sys.argv[1].encode(), len(sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
if len(sys.argv) > 2:
    os.execv(sys.executable, [sys.executable, "-c", os.environ["CHILD_CODE"], *sys.argv[2:]])
"""


@contextmanager
def child(*marks: str) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *marks], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "CHILD_CODE": CHILD})
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_reads_keep_one_file_open_per_process() -> None:
    memory = OpenMemory()
    with child("first") as proc:
        assert memory.read(proc.pid, ADDRESS, 5) == b"first"
        fds = _open_fds()
        assert memory.read(proc.pid, ADDRESS + 1, 4) == b"irst"
        assert (len(memory), _open_fds()) == (1, fds)
        memory.forget(proc.pid)
        assert (len(memory), _open_fds()) == (0, fds - 1)


def test_after_an_exec_the_new_image_is_read_not_the_old() -> None:
    memory = OpenMemory()
    with child("before", "after!") as proc:
        assert memory.read(proc.pid, ADDRESS, 6) == b"before"
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "ready\n"  # the exec'd image mapped its page
        assert memory.read(proc.pid, ADDRESS, 6) == read_memory(proc.pid, ADDRESS, 6) \
            == b"after!"
        assert len(memory) == 1


def test_a_process_that_exited_is_an_error_and_its_file_is_closed() -> None:
    memory = OpenMemory()
    with child("gone") as proc:
        assert memory.read(proc.pid, ADDRESS, 4) == b"gone"
    with pytest.raises(MemoryReadError):
        memory.read(proc.pid, ADDRESS, 4)
    assert len(memory) == 0


def test_at_most_max_open_files_are_held() -> None:
    """Past the bound, reads open and close as ``read_memory`` does; the
    files held stay held (a refresh reads every process in turn)."""
    memory = OpenMemory(max_open=1)
    with child("one") as first, child("two") as second:
        assert memory.read(first.pid, ADDRESS, 3) == b"one"
        fds = _open_fds()
        for _ in range(2):
            assert memory.read(second.pid, ADDRESS, 3) == b"two"
            assert memory.read(first.pid, ADDRESS, 3) == b"one"
            assert (len(memory), _open_fds()) == (1, fds)
        memory.forget(first.pid)
        assert memory.read(second.pid, ADDRESS, 3) == b"two"
        assert (len(memory), _open_fds()) == (1, fds)  # second's now


def test_the_default_bound_leaves_most_descriptors_free() -> None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    bound = OpenMemory().max_open
    assert 1 <= bound <= 1024
    if soft != resource.RLIM_INFINITY:
        assert bound <= max(1, soft // 8)


def test_sizes_beyond_the_bound_are_refused_before_opening(tmp_path: Path) -> None:
    memory = OpenMemory(proc_root=str(tmp_path))  # nothing there to open
    with pytest.raises(MemoryReadError, match="refusing"):
        memory.read(os.getpid(), ADDRESS, MAX_READ_BYTES + 1)
    with pytest.raises(MemoryReadError, match="cannot open"):
        memory.read(os.getpid(), ADDRESS, 8)
    assert len(memory) == 0


def test_a_write_lands_in_the_process_and_bad_writes_are_refused() -> None:
    with child("control word") as proc:
        write_memory(proc.pid, ADDRESS + 8, b"WORD")
        assert read_memory(proc.pid, ADDRESS, 12) == b"control WORD"
        for data in (b"", b"x" * (MAX_WRITE_BYTES + 1)):
            with pytest.raises(MemoryReadError, match="refusing to write"):
                write_memory(proc.pid, ADDRESS, data)
        with pytest.raises(MemoryReadError, match="Bad address"):
            write_memory(proc.pid, ADDRESS + (1 << 30), b"WORD")  # nothing mapped there
        # Across the end of the page: the part that fits is not a success.
        with pytest.raises(MemoryReadError):
            write_memory(proc.pid, ADDRESS + 4094, b"WORD")
        assert read_memory(proc.pid, ADDRESS, 12) == b"control WORD"


def test_a_write_to_a_process_that_exited_is_an_error() -> None:
    with child("gone") as proc:
        pid = proc.pid
    with pytest.raises(MemoryReadError):
        write_memory(pid, ADDRESS, b"WORD")
