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

from tramprof import bpf_layout
from tramprof.sampler import RawSample

TRUNCATED = "[truncated]"
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


def symbolize_user(frames: tuple[tuple[int, int], ...], resolve: UserResolver) -> list[str]:
    """Names for a leaf-first user stack, returned root first."""
    names = []
    for index, (ip, _sp) in enumerate(frames):
        names.append(resolve(ip if index == 0 else ip - 1))
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
                 failures: Counter[str]) -> tuple[str, ...]:
    """All frames of one sample, root first."""
    frames: list[str] = []
    has_user = not sample.user_flags & bpf_layout.USTACK_NO_USER
    if has_user:
        if sample.user_flags & bpf_layout.USTACK_TRUNCATED:
            frames.append(TRUNCATED)
        if user is None:
            frames.append(PROCESS_EXITED)
        else:
            frames.extend(symbolize_user(sample.user_frames, user))
    frames.extend(symbolize_kernel(sample.kernel_ips, kernel, failures))
    if sample.kernel_error:
        frames.append(KERNEL_LOST)
    return tuple(frames)
