"""Processes unwound through the trampoline runtime's chain ("chain" mode).

A process that loaded ``tramprof_trampolines`` publishes where its per-thread
chain head lives and where its stubs are (``trampolines/ABI.md``). The daemon
reads that descriptor from outside (``/proc/PID/mem``) and hands the BPF
program what it needs to walk and validate the chain: the TLS offset, the
stub stride and every arena page. Arenas are added as the process runs, so
the descriptor is re-read after every drain (cheap: one small read unless its
generation changed).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from tramprof.symbols.procmaps import Mapping
from tramprof.trampoline_descriptor import EXTENSION_RE, Descriptor, read_descriptor

log = logging.getLogger(__name__)

SUPPORTED_ABI = 1
X86_64 = 62


class ChainTarget(Protocol):
    """The part of the sampler that chain mode drives."""

    def set_chain_process(self, tgid: int, tls_offset: int, stub_stride: int,
                          arenas: Iterable[tuple[int, int]]) -> None: ...

    def clear_chain_process(self, tgid: int, arenas: Iterable[tuple[int, int]]) -> None: ...


@dataclass
class ChainProcess:
    """What is installed in the BPF maps for one process."""

    generation: int
    tls_offset: int
    stub_stride: int
    stub_return_offset: int
    arenas: tuple[tuple[int, int], ...]
    active: bool

    def is_stub(self, address: int) -> bool:
        return any(start <= address < end for start, end in self.arenas)


def _read_descriptor(pid: int) -> Descriptor:
    return read_descriptor(pid)


class ChainProcesses:
    """Per-process chain-mode state; the sampler's maps follow it."""

    def __init__(self, sampler: ChainTarget) -> None:
        self._sampler = sampler
        self._procs: dict[int, ChainProcess] = {}
        self._candidates: set[int] = set()  # runtime loaded, maybe not active yet
        self.errors = 0

    def __contains__(self, pid: int) -> bool:
        proc = self._procs.get(pid)
        return proc is not None and proc.active

    def get(self, pid: int) -> ChainProcess | None:
        return self._procs.get(pid)

    def consider(self, pid: int, mappings: Iterable[Mapping]) -> None:
        """A process was sampled for the first time: does it run the runtime?"""
        if any(EXTENSION_RE.search(m.path) for m in mappings):
            self._candidates.add(pid)
            self._update(pid)

    def refresh(self, live: set[int]) -> None:
        """After a drain: follow new arenas and activations, forget exited processes."""
        for pid in list(self._candidates):
            if pid not in live:
                self.forget(pid)
            else:
                self._update(pid)

    def forget(self, pid: int) -> None:
        self._candidates.discard(pid)
        proc = self._procs.pop(pid, None)
        if proc is not None:
            self._sampler.clear_chain_process(pid, proc.arenas)

    def _update(self, pid: int) -> None:
        try:
            d = _read_descriptor(pid)
        except Exception as exc:  # the reader's own error, or the process vanished
            self.errors += 1
            log.debug("no trampoline descriptor for pid %d: %s", pid, exc)
            return
        known = self._procs.get(pid)
        if known is not None and known.generation == d.generation:
            return
        if d.abi_version != SUPPORTED_ABI or d.arch != X86_64 or d.record_prev_offset != 0 \
                or d.record_self_offset != 8 or d.stub_stride <= 0:
            self.errors += 1
            log.warning("pid %d: trampoline runtime ABI %d (arch %d) is not supported",
                        pid, d.abi_version, d.arch)
            self._candidates.discard(pid)
            return
        arenas = tuple(d.arenas)
        proc = ChainProcess(generation=d.generation, tls_offset=d.tls_offset,
                            stub_stride=d.stub_stride,
                            stub_return_offset=d.stub_return_offset, arenas=arenas,
                            active=bool(d.active) or (known is not None and known.active))
        # Stubs stay on stacks after deactivate(): keep walking what exists.
        if proc.active:
            new = [a for a in arenas if known is None or a not in known.arenas]
            self._sampler.set_chain_process(pid, d.tls_offset, d.stub_stride, new)
        self._procs[pid] = proc

    def mode(self, pid: int) -> str:
        return "chain" if pid in self else "fp"
