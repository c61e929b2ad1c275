"""Turns raw samples (addresses) into named stacks, root first.

User frames come before kernel frames of the same sample, as flame graphs
draw them. Return addresses are looked up one byte back so that a call at the
very end of a function (e.g. to a noreturn function) names the caller, not
whatever follows it. Cut or lost parts of a stack are shown as one bracketed
marker frame, never as made-up names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tramprof import bpf_layout
from tramprof.sampler import RawSample

TRUNCATED = "[truncated]"
# Native frames between the last one the frame-pointer walk reached and the
# trampoline frames above it could not be unwound (code without frame pointers).
NATIVE_GAP = "[native frames not unwound]"
KERNEL_LOST = "[kernel stack lost]"
PROCESS_EXITED = "[process exited]"
UNKNOWN_KERNEL = "[unknown kernel]"


@dataclass(frozen=True)
class Stack:
    """A symbolized, aggregated stack of one process."""

    pid: int
    process: str  # the process's name (its main thread's comm)
    comm: str  # the sampled thread's name
    frames: tuple[str, ...]  # root first
    count: int

    def folded_key(self) -> tuple[str, ...]:
        return (self.comm, *self.frames)


# (address, is_return_address) -> name; the user resolver belongs to one process image.
UserResolver = Callable[[int], str]
KernelResolver = Callable[[int], str | None]


class StubSet(Protocol):
    """Where a process's trampoline stubs are (chain mode)."""

    def is_stub(self, address: int) -> bool: ...


def user_addresses(sample: RawSample, stubs: StubSet | None) -> list[int | str]:
    """Lookup addresses of the user stack, leaf first, with the trampoline chain
    merged in by stack address (markers as strings).

    Return addresses are moved one byte back (into the call instruction);
    chain frames are stub starts, looked up as they are. A stub's own native
    frame is dropped: its chain frame, named from the perf map, stands in.
    """
    native = [(sp, ip if i == 0 else ip - 1) for i, (ip, sp) in enumerate(sample.user_frames)]
    if not sample.chain or stubs is None:
        return [addr for _sp, addr in native]
    native = [(sp, addr) for sp, addr in native if not stubs.is_stub(addr)]
    reached = native[-1][0] if native else 0
    incomplete = bool(sample.user_flags & bpf_layout.USTACK_FAULT)
    merged = sorted(native + [(sp, ip) for ip, sp in sample.chain], key=lambda f: f[0])
    out: list[int | str] = []
    gap_marked = False
    for sp, addr in merged:
        if incomplete and not gap_marked and native and sp > reached:
            out.append(NATIVE_GAP)
            gap_marked = True
        out.append(addr)
    return out


def symbolize_user(addresses: list[int | str], resolve: UserResolver) -> list[str]:
    """Names for leaf-first lookup addresses, returned root first."""
    names = [a if isinstance(a, str) else resolve(a) for a in addresses]
    names.reverse()
    return names


def symbolize_kernel(ips: tuple[int, ...], resolve: KernelResolver,
                     failures: Counter[str]) -> list[str]:
    names = []
    for index, ip in enumerate(ips):
        name = resolve(ip if index == 0 else ip - 1)
        if name is None:
            failures["kernel_no_symbol"] += 1
            name = UNKNOWN_KERNEL
        names.append(name)
    names.reverse()
    return names


def stack_frames(sample: RawSample, user: UserResolver | None, kernel: KernelResolver,
                 failures: Counter[str], stubs: StubSet | None = None) -> tuple[str, ...]:
    """All frames of one sample, root first."""
    frames: list[str] = []
    has_user = not sample.user_flags & bpf_layout.USTACK_NO_USER
    if has_user:
        if sample.user_flags & (bpf_layout.CHAIN_TRUNCATED | bpf_layout.SCAN_TRUNCATED) or (
                sample.user_flags & bpf_layout.USTACK_TRUNCATED and not sample.chain):
            frames.append(TRUNCATED)
        if user is None:
            frames.append(PROCESS_EXITED)
        else:
            frames.extend(symbolize_user(user_addresses(sample, stubs), user))
    frames.extend(symbolize_kernel(sample.kernel_ips, kernel, failures))
    if sample.kernel_error:
        frames.append(KERNEL_LOST)
    return tuple(frames)
