"""Names the frames of one raw sample, root first.

User frames come before kernel frames of the same sample, as flame graphs
draw them. Cut or lost parts of a stack are shown as one bracketed marker
frame, never as made-up names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from tramprof.model import (
    KERNEL_LOST,
    PROCESS_EXITED,
    TRUNCATED,
    UNKNOWN_KERNEL,
    RawSample,
)
from tramprof.sampler import layout
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.merge import is_truncated, user_addresses

# address -> name; the user resolver belongs to one process image.
UserResolver = Callable[[int], str]
KernelResolver = Callable[[int], str | None]


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
                 failures: Counter[str], stubs: Arenas | None = None) -> tuple[str, ...]:
    """All frames of one sample, root first."""
    frames: list[str] = []
    if not sample.user_flags & layout.USTACK_NO_USER:
        if is_truncated(sample):
            frames.append(TRUNCATED)
        if user is None:
            frames.append(PROCESS_EXITED)
        else:
            frames.extend(symbolize_user(user_addresses(sample, stubs), user))
    frames.extend(symbolize_kernel(sample.kernel_ips, kernel, failures))
    if sample.kernel_error:
        frames.append(KERNEL_LOST)
    return tuple(frames)
