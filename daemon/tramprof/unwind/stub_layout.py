"""The layout of trampoline stubs we do not control, learnt from their bytes.

CPython 3.12+ ``-X perf`` fills 64 KiB anonymous executable arenas with
identical copies of a small stub (x86-64 3.12/3.13:
``[endbr64] sub $8,%rsp; call *%rcx; add $8,%rsp; ret``; 3.14: ``push %rbp;
mov %rsp,%rbp; call *%rcx; ...``) and names each copy it hands out in its
perf map. While a Python frame runs, the stub's return address (the byte
after its ``call *%rcx``) sits on the native stack.

Everything here is a pure function of bytes and addresses, never of a
version number: the return offset is the end of the stub's ``call *%rcx``,
the stride the smallest distance between named stubs (cross-checked against
the period of the arena's bytes), and an arena is trusted only when every
copy in it is byte-identical to the named stub. Anything else raises
``LayoutError`` with a reason that is counted.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from tramprof.procfs.maps import Mapping

PAGE = 0x1000
CALL_RCX = b"\xff\xd1"
MAX_ARENA_BYTES = 1 << 20     # CPython's arenas are 64 KiB; refuse anything huge
MAX_STUB_BYTES = 256


class LayoutError(ValueError):
    """Stub bytes or arenas do not look like the trampolines we can scan for."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class StubLayout:
    return_offset: int  # return address minus stub start
    stride: int         # distance between stub copies
    stub: bytes         # the stub's bytes (perf map size)
    # The caller's return address minus the stub's, on the stack (None: the
    # stub's prologue has an instruction we do not model).
    caller_offset: int | None = None


@dataclass(frozen=True)
class CallerCheck:
    """Where a running stub's caller left its return address, and the text it
    must point into. A word that looks like a stub return address but lacks
    this is a stale copy in a live C frame, not a running Python frame."""

    offset: int  # caller's return address minus the stub's, on the stack
    start: int   # the interpreter's executable text (start == end: unknown, no check)
    end: int

    @property
    def checks_text(self) -> bool:
        return self.end > self.start

    @property
    def word_phase(self) -> int:
        """Where the stub's return addresses lie (``tp_scan_proc.word_phase``):
        its caller called it on a 16-byte aligned stack, so at 16n + 8 -
        offset % 16. 1: at 16n, 2: at 16n + 8."""
        return 1 if (8 - self.offset) % 16 == 0 else 2 if self.offset % 8 == 0 else 0


# Instructions a stub may run before its call, and the bytes each puts on the
# stack between the stub's return address and its caller's.
_PROLOGUE = ((b"\xf3\x0f\x1e\xfa", 0),  # endbr64
             (b"\x55", 8),                # push %rbp
             (b"\x48\x89\xe5", 0))        # mov %rsp,%rbp
_SUB_RSP_IMM8 = b"\x48\x83\xec"            # sub $imm8,%rsp
MAX_CALLER_OFFSET = 248                       # the BPF program looks 31 words up at most


def return_offset(stub: bytes) -> int:
    """Offset just past the stub's single ``call *%rcx``."""
    at = stub.find(CALL_RCX)
    if at < 0:
        raise LayoutError("no_call", f"no call *%rcx in stub bytes {stub.hex()}")
    if stub.find(CALL_RCX, at + 1) >= 0:
        raise LayoutError("ambiguous_call", f"two call *%rcx in stub bytes {stub.hex()}")
    return at + len(CALL_RCX)


def caller_offset(stub: bytes, return_offset: int) -> int | None:
    """Distance from the stub's return address on the stack up to its caller's,
    from the instructions before the call (CPython 3.12/3.13 x86-64: ``sub
    $8,%rsp`` -> 16; 3.14: ``push %rbp; mov %rsp,%rbp`` -> 16)."""
    at, pushed, end = 0, 0, return_offset - len(CALL_RCX)
    while at < end:
        for code, size in _PROLOGUE:
            if stub.startswith(code, at):
                at += len(code)
                pushed += size
                break
        else:
            if not stub.startswith(_SUB_RSP_IMM8, at) or at + 4 > end or stub[at + 3] >= 0x80:
                return None
            pushed += stub[at + 3]
            at += 4
    offset = 8 + pushed
    return offset if at == end and offset % 8 == 0 and offset <= MAX_CALLER_OFFSET else None


def interpreter_text(mappings: Sequence[Mapping], exe_inode: int | None) -> tuple[int, int] | None:
    """The executable text that calls the stubs: libpython's when the process
    has it mapped, else the main executable's (a statically linked python)."""
    text = [m for m in mappings if m.is_exec and m.inode != 0]
    chosen = [m for m in text if os.path.basename(m.path).startswith("libpython")]
    if not chosen and exe_inode is not None:
        chosen = [m for m in text if m.inode == exe_inode]
    if not chosen or len({(m.inode, m.path) for m in chosen}) != 1:
        return None
    return min(m.start for m in chosen), max(m.end for m in chosen)


def stride_from_addresses(addresses: Iterable[int]) -> int | None:
    """Smallest distance between distinct stub addresses (None: fewer than two)."""
    ordered = sorted(set(addresses))
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    return min(gaps) if gaps else None


def byte_period(data: bytes, minimum: int, maximum: int = MAX_STUB_BYTES) -> int | None:
    """Smallest period p (minimum <= p <= maximum) with data[i] == data[i + p]."""
    for p in range(max(1, minimum), min(maximum, len(data) // 2) + 1):
        if data[p:] == data[:-p]:
            return p
    return None


def learn_layout(stub: bytes, arena: bytes, arena_start: int, stub_start: int,
                 addresses: Sequence[int] = ()) -> StubLayout:
    """The scan layout of one arena, verified against its bytes.

    ``stub``: the named stub's bytes (perf map size); ``arena``: the whole
    arena's bytes; ``addresses``: perf map stub addresses in this arena."""
    if not 0 < len(stub) <= MAX_STUB_BYTES:
        raise LayoutError("stub_size", f"stub size {len(stub)}")
    offset = return_offset(stub)
    period = byte_period(arena, len(stub))
    named = stride_from_addresses(addresses)
    stride = period or named
    if stride is None:
        raise LayoutError("no_stride", "one stub named and the arena bytes do not repeat")
    if named is not None and named % stride:
        raise LayoutError("stride_mismatch", f"stub addresses {named} apart, arena bytes "
                          f"repeat every {stride}")
    if stride < len(stub) or stride & (stride - 1) or PAGE % stride:
        raise LayoutError("stride", f"stride {stride} (stub {len(stub)} bytes) is not a power "
                          "of two dividing the page size")
    if offset >= len(stub):
        raise LayoutError("no_call", "call *%rcx is the stub's last instruction")
    verify_arena(arena, arena_start, StubLayout(offset, stride, stub), stub_start)
    return StubLayout(offset, stride, stub, caller_offset(stub, offset))


def verify_arena(arena: bytes, arena_start: int, layout: StubLayout,
                 stub_start: int | None = None) -> None:
    """Every copy in the arena, at stride intervals from its page-aligned
    start, is the stub byte for byte."""
    if arena_start % PAGE or not arena or len(arena) % PAGE:
        raise LayoutError("arena_alignment", f"arena at {arena_start:#x}+{len(arena):#x}")
    if stub_start is not None and (stub_start - arena_start) % layout.stride:
        raise LayoutError("stub_alignment", f"stub {stub_start:#x} is off the arena's "
                          f"{layout.stride}-byte grid")
    size = len(layout.stub)
    for at in range(0, len(arena) - size + 1, layout.stride):
        if arena[at:at + size] != layout.stub:
            raise LayoutError("arena_bytes", f"copy at {arena_start + at:#x} differs: "
                              f"{arena[at:at + size].hex()} != {layout.stub.hex()}")
