"""Compiles one object's unwind table in a short-lived child process.

pyelftools decodes call-frame information into a Python object per
instruction: node's binary alone peaks at hundreds of MB and leaves the
heap fragmented for the daemon's lifetime (measured on a busy node: a
700 MB peak, a 400 MB steady state after the builds, for ~130 MB of live
objects). In a child, all of it goes back to the system when the child
exits. The child is a fresh interpreter (not a fork of the threaded daemon)
that gets the opened object as its standard input, compiles it with
``cfi.compile_table`` and writes the result on its standard output: one
JSON line, then the packed rows. A child that fails, runs out of its
address-space limit, sends too much or takes too long is an error of that
object only.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import subprocess
import sys
from collections import Counter
from typing import Any, BinaryIO

from tramprof.unwind.cfi import MAX_ROWS, ROW_BYTES, CfiError, UnwindTable, compile_table

#: Address space a build may use (its peak for node's binary is ~600 MB).
ADDRESS_SPACE_LIMIT = 2 << 30
#: Longest a build may take (node's binary: ~30 s on a loaded 2-core machine).
TIMEOUT_SECONDS = 600.0
_MAX_HEADER_BYTES = 1 << 16
_PR_SET_PDEATHSIG = 1

Segments = tuple[tuple[int, int, int], ...]


def build_in_child(f: BinaryIO, timeout: float = TIMEOUT_SECONDS,
                   address_space: int = ADDRESS_SPACE_LIMIT) -> tuple[UnwindTable, Segments]:
    """The table and executable segments of the object open as ``f``;
    CfiError for the object's faults, OSError when the child cannot run."""
    child = subprocess.Popen([sys.executable, "-m", "tramprof.unwind.cfibuild",
                              str(address_space)],
                             stdin=f.fileno(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise CfiError(f"compiling the unwind table took more than {timeout:.0f} s") from None
    header, newline, rows = out.partition(b"\n")
    if child.returncode != 0 or not newline or len(header) > _MAX_HEADER_BYTES:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise CfiError(f"the table compiler exited with status {child.returncode}: "
                       + " | ".join(tail))
    return _unpack(json.loads(header), rows)


def _unpack(header: dict[str, Any], rows: bytes) -> tuple[UnwindTable, Segments]:
    if "error" in header:
        raise CfiError(str(header["error"]))
    row_count = int(header["row_count"])
    if not 0 <= row_count <= MAX_ROWS or len(rows) != row_count * ROW_BYTES:
        raise CfiError(f"the table compiler sent {len(rows)} bytes for {row_count} rows")
    table = UnwindTable(rows=rows, row_count=row_count, fdes=int(header["fdes"]),
                        fp_share=float(header["fp_share"]),
                        unsupported=Counter({str(k): int(v)
                                             for k, v in header["unsupported"].items()}))
    segments = tuple((int(o), int(v), int(s)) for o, v, s in header["segments"])
    return table, segments


def executable_segments(f: BinaryIO) -> Segments:
    """(file offset, address, size) of each executable PT_LOAD segment."""
    from elftools.elf.elffile import ELFFile

    f.seek(0)
    elf = ELFFile(f)
    return tuple((int(seg["p_offset"]), int(seg["p_vaddr"]), int(seg["p_filesz"]))
                 for seg in elf.iter_segments()
                 if seg["p_type"] == "PT_LOAD" and seg["p_flags"] & 1)


def _compile(f: BinaryIO, address_space: int) -> tuple[dict[str, Any], bytes]:
    try:
        table = compile_table(f)
        segments = executable_segments(f)
    except (CfiError, OSError, ValueError) as exc:
        return {"error": str(exc)}, b""
    except MemoryError:
        return {"error": f"more than {address_space >> 20} MiB to compile"}, b""
    return {"row_count": table.row_count, "fdes": table.fdes, "fp_share": table.fp_share,
            "unsupported": dict(table.unsupported),
            "segments": [list(s) for s in segments]}, table.rows


def main(argv: list[str]) -> None:
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    address_space = int(argv[0])
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    with os.fdopen(0, "rb") as f:
        header, rows = _compile(f, address_space)
    out = sys.stdout.buffer
    out.write(json.dumps(header).encode() + b"\n")
    out.write(rows)
    out.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
