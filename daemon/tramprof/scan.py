"""Processes unwound by scanning their stacks ("scan" mode).

For trampoline stubs we do not control — CPython 3.12+ ``-X perf`` — there is
no chain to walk. CPython fills 64 KiB anonymous executable arenas with
identical copies of a small stub (x86-64 3.12/3.13:
``[endbr64] sub $8,%rsp; call *%rcx; add $8,%rsp; ret``) and names each copy
it hands out in ``/tmp/perf-PID.map`` (``py::QUALNAME:FILE``, size = stub
size). While a Python frame runs, the stub's return address (the byte after
its ``call *%rcx``) sits on the native stack, so the BPF program can find one
word per Python frame by scanning a window of the stack.

The layout is learnt from the stub's own bytes, never assumed from a version
number: the return offset is the end of the stub's ``call *%rcx``, the stride
the smallest distance between named stubs (cross-checked against the period
of the arena's bytes), and an arena is trusted only when every copy in it is
byte-identical to the named stub. Anything else is refused and counted.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tramprof.procinfo import read_nstgid
from tramprof.symbols.procmaps import Mapping, read_maps

log = logging.getLogger(__name__)

PAGE = 0x1000
CALL_RCX = b"\xff\xd1"
MAX_ARENA_BYTES = 1 << 20     # CPython's arenas are 64 KiB; refuse anything huge
MAX_STUB_BYTES = 256
MAX_PERF_MAP_READ = 4 << 20   # per refresh


class ScanTarget(Protocol):
    """The part of the sampler that scan mode drives."""

    def set_scan_process(self, tgid: int, return_offset: int, stride: int,
                         arenas: Iterable[tuple[int, int]],
                         caller: CallerCheck | None = None) -> None: ...

    def clear_scan_process(self, tgid: int, arenas: Iterable[tuple[int, int]]) -> None: ...


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


def _is_anon_exec(m: Mapping) -> bool:
    return m.is_exec and m.inode == 0 and (m.path == "" or m.path.startswith("[anon"))


@dataclass
class ScanProcess:
    """What is installed in the BPF maps for one process."""

    layout: StubLayout
    arenas: tuple[tuple[int, int], ...]
    caller: CallerCheck | None = None

    def is_stub(self, address: int) -> bool:
        return any(start <= address < end for start, end in self.arenas)


@dataclass
class _Candidate:
    perf_map: str
    offset: int = 0
    partial: bytes = b""
    stubs: list[tuple[int, int]] = field(default_factory=list)  # (address, size) of py:: lines


class ScanProcesses:
    """Per-process scan-mode state; the sampler's maps follow it."""

    def __init__(self, sampler: ScanTarget, proc_root: str = "/proc") -> None:
        self._sampler = sampler
        self._proc_root = proc_root
        self._procs: dict[int, ScanProcess] = {}
        self._candidates: dict[int, _Candidate] = {}
        self._refused: set[int] = set()
        self.refusals: Counter[str] = Counter()

    def __contains__(self, pid: int) -> bool:
        return pid in self._procs

    def get(self, pid: int) -> ScanProcess | None:
        return self._procs.get(pid)

    def mode(self, pid: int) -> str | None:
        return "scan" if pid in self._procs else None

    def consider(self, pid: int, mappings: Iterable[Mapping]) -> None:
        """A process was sampled for the first time: may it run CPython's
        trampolines? (It has anonymous executable memory.)"""
        if pid in self._candidates or pid in self._refused:
            return
        if not any(_is_anon_exec(m) for m in mappings):
            return
        try:
            inner = read_nstgid(pid, self._proc_root)[-1]
        except (OSError, IndexError, ValueError):
            inner = pid
        self._candidates[pid] = _Candidate(f"{self._proc_root}/{pid}/root/tmp/perf-{inner}.map")
        self._update(pid)

    def refresh(self, live: set[int], skip: Iterable[int] = ()) -> None:
        """After a drain: follow new arenas; forget exited processes.
        ``skip``: processes unwound another way (chain mode)."""
        skipped = set(skip)
        for pid in list(self._candidates):
            if pid not in live:
                self.forget(pid)
            elif pid in skipped:
                self.forget(pid)
                self._refused.add(pid)
            else:
                self._update(pid)
        self._refused &= live

    def forget(self, pid: int) -> None:
        self._candidates.pop(pid, None)
        proc = self._procs.pop(pid, None)
        if proc is not None:
            self._sampler.clear_scan_process(pid, proc.arenas)

    def _refuse(self, pid: int, reason: str, detail: str) -> None:
        self.refusals[reason] += 1
        log.warning("pid %d: not scanning its stack for trampoline frames: %s (%s)",
                    pid, reason, detail)
        self.forget(pid)
        self._refused.add(pid)

    def _read_perf_map(self, cand: _Candidate) -> bool:
        """Appends new py:: entries; True when there were any."""
        try:
            with open(cand.perf_map, "rb") as f:
                f.seek(cand.offset)
                data = f.read(MAX_PERF_MAP_READ)
        except OSError:
            return False
        cand.offset += len(data)
        data = cand.partial + data
        lines = data.split(b"\n")
        cand.partial = lines.pop()
        found = False
        for line in lines:
            parts = line.split(b" ", 2)
            if len(parts) != 3 or not parts[2].startswith(b"py::"):
                continue
            try:
                cand.stubs.append((int(parts[0], 16), int(parts[1], 16)))
            except ValueError:
                continue
            found = True
        return found

    def _update(self, pid: int) -> None:
        cand = self._candidates[pid]
        if not self._read_perf_map(cand):
            return
        known = self._procs.get(pid)
        if known is not None:
            cand.stubs = [s for s in cand.stubs if not known.is_stub(s[0])]
            if not cand.stubs:
                return
        try:
            all_maps = read_maps(pid, self._proc_root)
            maps = [m for m in all_maps if _is_anon_exec(m)]
        except OSError as exc:
            log.debug("pid %d: cannot read maps: %s", pid, exc)
            return
        arenas = {}
        for address, size in cand.stubs:
            m = next((m for m in maps if m.start <= address < m.end), None)
            if m is not None and (m.start, m.end) not in arenas:
                arenas[(m.start, m.end)] = (address, size)
        if known is not None:
            for arena in known.arenas:
                arenas.pop(arena, None)
        if not arenas:
            cand.stubs.clear()
            return
        try:
            layout = known.layout if known is not None else None
            for (start, end), (address, size) in sorted(arenas.items()):
                if end - start > MAX_ARENA_BYTES:
                    raise LayoutError("arena_size", f"{end - start} bytes at {start:#x}")
                data = self._read_mem(pid, start, end - start)
                if layout is None:
                    stub = data[address - start:address - start + size]
                    addresses = [a for a, _ in cand.stubs if start <= a < end]
                    layout = learn_layout(stub, data, start, address, addresses)
                else:
                    verify_arena(data, start, layout, address)
        except LayoutError as exc:
            self._refuse(pid, exc.reason, str(exc))
            return
        except OSError as exc:
            log.debug("pid %d: cannot read arena: %s", pid, exc)
            return
        assert layout is not None
        all_arenas = tuple(sorted({*arenas, *(known.arenas if known else ())}))
        caller = known.caller if known is not None else self._caller_check(pid, layout, all_maps)
        try:
            self._sampler.set_scan_process(pid, layout.return_offset, layout.stride, all_arenas,
                                           caller)
        except ValueError as exc:
            self._refuse(pid, "layout", str(exc))
            return
        if known is None:
            log.info("pid %d: scanning its stack for trampoline frames (return offset %d, "
                     "stride %d, %s)", pid, layout.return_offset, layout.stride,
                     _describe_caller(caller))
        self._procs[pid] = ScanProcess(layout=layout, arenas=all_arenas, caller=caller)
        cand.stubs.clear()

    def _caller_check(self, pid: int, layout: StubLayout,
                      mappings: Sequence[Mapping]) -> CallerCheck | None:
        if layout.caller_offset is None:
            return None
        try:
            exe_inode: int | None = os.stat(f"{self._proc_root}/{pid}/exe").st_ino
        except OSError:
            exe_inode = None
        text = interpreter_text(mappings, exe_inode) or (0, 0)
        return CallerCheck(layout.caller_offset, *text)

    def _read_mem(self, pid: int, start: int, size: int) -> bytes:
        fd = os.open(f"{self._proc_root}/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.pread(fd, size, start)
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"short read of {size} bytes at {start:#x}")
        return data


def _describe_caller(caller: CallerCheck | None) -> str:
    if caller is None:
        return "every word scanned, stale words not filtered: the stub's prologue is unknown"
    if not caller.checks_text:
        return ("stale words not filtered: the interpreter's text was not found "
                "(no libpython and no mapping of the executable)")
    return (f"caller's return address {caller.offset} bytes up, in "
            f"{caller.start:#x}-{caller.end:#x}")


def describe(proc: ScanProcess) -> str:
    return (f"scan: CPython -X perf stubs, return offset {proc.layout.return_offset}, "
            f"stride {proc.layout.stride}, {len(proc.arenas)} arenas, "
            f"{_describe_caller(proc.caller)}")
