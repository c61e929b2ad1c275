"""Decodes one idle buffer of the BPF maps into ``RawSample``s and empties it.

Only unique (process, thread, kernel stack, user stack) keys cross to user
space, with their counts; user stacks are shared by many keys, so each is
read once per drain.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

from tramprof.model import RawSample
from tramprof.sampler import layout

# tp_sample_key.kstack_id of a sample without a kernel part.
NO_KSTACK = -1

# (native frames, trampoline frames, flags) of one stored user stack.
_UserStack = tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], int]


def drain_buffer(bpf: Any, buffer: int) -> list[RawSample]:
    """Every sample counted in ``buffer`` (0 or 1), which no program writes
    any more; its entries are deleted afterwards."""
    counts = bpf.get_table(b"counts", keytype=layout.CountKey, leaftype=ctypes.c_uint64)
    ustacks = bpf.get_table(b"ustacks", keytype=layout.UserStackKey,
                            leaftype=layout.UserStack)
    kstacks = bpf[f"kstacks{buffer}".encode()]

    entries = [(bytes(k), k.sample, int(v.value)) for k, v in counts.items()
               if k.buffer == buffer]
    user_cache: dict[int, _UserStack] = {}
    kernel_cache: dict[int, tuple[int, ...]] = {}
    samples = []
    for _raw, key, count in entries:
        user: tuple[tuple[int, int], ...] = ()
        tramp: tuple[tuple[int, int], ...] = ()
        flags = layout.USTACK_NO_USER
        if key.ustack_hash:
            if key.ustack_hash not in user_cache:
                user_cache[key.ustack_hash] = _read_user_stack(ustacks, key.ustack_hash, buffer)
            user, tramp, flags = user_cache[key.ustack_hash]
        kernel: tuple[int, ...] = ()
        kernel_error = 0
        if key.kstack_id >= 0:
            if key.kstack_id not in kernel_cache:
                kernel_cache[key.kstack_id] = tuple(kstacks.walk(key.kstack_id))
            kernel = kernel_cache[key.kstack_id]
        elif key.kstack_id != NO_KSTACK:
            kernel_error = key.kstack_id
        samples.append(RawSample(
            tgid=key.tgid, start_boottime_ns=key.start_boottime, exec_id=key.exec_id,
            comm=key.comm.decode(errors="replace"), user_frames=user, user_flags=flags,
            kernel_ips=kernel, kernel_error=kernel_error, trampoline_frames=tramp,
            count=count))

    for raw, _key, _count in entries:
        with contextlib.suppress(KeyError):
            del counts[layout.CountKey.from_buffer_copy(raw)]
    for skey in [k for k in ustacks if k.buffer == buffer]:
        with contextlib.suppress(KeyError):
            del ustacks[skey]
    for stack_id in kernel_cache:
        with contextlib.suppress(KeyError):
            del kstacks[kstacks.Key(stack_id)]
    return samples


def _read_user_stack(table: Any, stack_hash: int, buffer: int) -> _UserStack:
    try:
        stack = table[layout.UserStackKey(hash=stack_hash, buffer=buffer)]
    except KeyError:
        return (), (), layout.USTACK_FAULT
    n = min(int(stack.nr), layout.MAX_FRAMES)
    frames = tuple((int(stack.frames[i].ip), int(stack.frames[i].sp)) for i in range(n))
    n = min(int(stack.nr_tramp), layout.MAX_TRAMP)
    tramp = tuple((int(stack.tramp[i].ip), int(stack.tramp[i].sp)) for i in range(n))
    return frames, tramp, int(stack.flags)
