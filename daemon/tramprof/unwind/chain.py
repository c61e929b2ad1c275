"""Chain mode: processes running our trampoline runtime.

A process that loaded ``tramprof_trampolines`` publishes where its per-thread
chain head lives and where its stubs are (``trampolines/ABI.md``). This mode
reads that descriptor from outside (``unwind.descriptor``) and installs what
the BPF chain walker (``bpf/chain_walk.h``) needs to walk and validate the
chain: the TLS offset, the stub stride and every arena page. Arenas are
added as the process runs, so the descriptor of a process sampled in a drain
is re-read after it, and of one whose chain met an arena not installed at
the next refresh (cheap: one small read unless its generation changed).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass

from tramprof.procfs.maps import Mapping
from tramprof.sampler import layout
from tramprof.sampler.maps import MapFull
from tramprof.unwind.arenas import Arenas
from tramprof.unwind.descriptor import (
    PAUSED_OFFSET,
    Descriptor,
    DescriptorError,
    DescriptorLocator,
    DutyState,
    is_runtime_extension,
    read_changes,
    read_descriptor,
)
from tramprof.unwind.duty import DutyCycle
from tramprof.unwind.mode import FP, MapWriter, ModeReport, Newcomers

log = logging.getLogger(__name__)

SUPPORTED_ABIS = (1, 2)
X86_64 = 62
WALKER = b"chain_procs"


@dataclass
class ChainProcess:
    """What is installed in the BPF maps for one process."""

    generation: int
    arenas: Arenas
    active: bool
    descriptor: Descriptor


def _unsupported(d: Descriptor) -> str:
    """Why the BPF walker cannot walk this runtime's chain ("": it can)."""
    if d.abi_version not in SUPPORTED_ABIS:
        return (f"descriptor ABI {d.abi_version} (this daemon walks "
                f"{', '.join(map(str, SUPPORTED_ABIS))})")
    if d.arch != X86_64:
        return f"architecture {d.arch} (ELF e_machine; only x86-64 is walked)"
    if d.record_prev_offset != 0 or d.record_self_offset != 8:
        return (f"chain records with prev at {d.record_prev_offset}, self at "
                f"{d.record_self_offset} (the walker expects 0 and 8)")
    if d.stub_stride <= 0:
        return f"stub stride {d.stub_stride}"
    return ""


class ChainMode:
    """Per-process chain-mode state; the BPF maps follow it."""

    sample_counter = layout.Counter.CHAIN_SAMPLES
    name = "chain"

    def __init__(self, maps: MapWriter, proc_root: str = "/proc",
                 python_overhead_budget: float = 0.0) -> None:
        self._maps = maps
        self._proc_root = proc_root
        self._locator = DescriptorLocator(proc_root=proc_root)
        #: Duty cycles of the runtimes that have one (ABI 2).
        self.duty = DutyCycle(python_overhead_budget, proc_root)
        self._procs: dict[int, ChainProcess] = {}
        self._candidates: set[int] = set()  # runtime loaded, maybe not active yet
        self._newcomers = Newcomers()  # activating, making their first arenas
        #: Reports of the walker taken by ``follow`` for the next ``refresh``.
        self._stale: set[int] = set()
        self._last_error: dict[int, tuple[str, str]] = {}  # pid -> (reason, detail)
        self._errors: Counter[str] = Counter()

    def unwinds(self, pid: int) -> bool:
        proc = self._procs.get(pid)
        return proc is not None and proc.active

    def unwound(self) -> set[int]:
        return {pid for pid, proc in self._procs.items() if proc.active}

    def arenas(self, pid: int) -> Arenas | None:
        proc = self._procs.get(pid)
        return proc.arenas if proc is not None and proc.active else None

    def errors(self) -> Counter[str]:
        return Counter(self._errors)

    def consider(self, pid: int, mappings: Sequence[Mapping]) -> None:
        if pid not in self._candidates and any(is_runtime_extension(m.path) for m in mappings):
            self._candidates.add(pid)
            self._update(pid, mappings)
            self._newcomers.add(pid)

    def refresh(self, live: set[int], full: bool = True,
                sampled: Container[int] | None = None) -> None:
        """With an overhead budget to keep, or after a drain whose samples are
        not known: every runtime's descriptor. Otherwise only those not active
        yet, those a new arena may have changed (the walker met a stub outside
        the installed arenas) and, after a drain, those it had samples of: the
        walker reports an arena it meets that is not installed, so a process
        with no samples needs no look. Reading 80 Python processes'
        descriptors at every refresh was ~0.15% of a core on a busy node.
        Exited processes are forgotten after a drain."""
        stale = self._maps.take_stale_chains() | self._stale
        self._stale = set()
        if self.duty.budget > 0 or (full and sampled is None):
            looked_at = set(self._candidates)
        else:
            ran = sampled if full and sampled is not None else ()
            looked_at = {pid for pid in self._candidates & live
                         if pid in stale or pid in ran or not self.unwinds(pid)}
            if full:
                looked_at |= self._candidates - live
        for pid in looked_at:
            if pid not in live:
                self.forget(pid)
            elif (duty := self._update(pid)) is not None:
                self.duty.update(pid, duty)

    def follow(self, live: set[int]) -> None:
        """Newcomers not active yet, and those whose chain met an arena not
        installed (the walker's report: reading every newcomer's descriptor
        at every wake was ~1 ms of CPU per runtime process started)."""
        due = self._newcomers.due(live, self._candidates)
        if not due:
            return
        stale = self._maps.take_stale_chains()
        for pid in due:
            if pid in stale or not self.unwinds(pid):
                stale.discard(pid)
                self._update(pid)
        self._stale |= stale  # the others' reports, for the next refresh

    def following(self) -> bool:
        return bool(self._newcomers)

    def forget(self, pid: int) -> None:
        self._newcomers.discard(pid)
        self.duty.forget(pid)
        self._locator.forget(pid)
        self._candidates.discard(pid)
        self._last_error.pop(pid, None)
        if self._procs.pop(pid, None) is not None:
            self._maps.remove(pid, WALKER)

    def _fail(self, pid: int, reason: str, detail: str, drop: bool) -> None:
        """Count a failure; ``drop``: give the process up for good."""
        if self._last_error.get(pid, ("", ""))[0] != reason:
            self._errors[reason] += 1
            log.log(logging.WARNING if drop else logging.DEBUG,
                    "pid %d: not walking its trampoline chain: %s (%s)", pid, reason, detail)
        self._last_error[pid] = (reason, detail)
        if drop:
            self.duty.forget(pid)
            self._locator.forget(pid)
            if self._procs.pop(pid, None) is not None:
                self._maps.remove(pid, WALKER)
            self._candidates.discard(pid)

    def _update(self, pid: int, mappings: Sequence[Mapping] | None = None,
                ) -> DutyState | None:
        """Follow a change of the process's descriptor; its duty words, if
        read and not already given to the duty cycle (a runtime just found).
        ``mappings``: its maps, just read (they locate a new descriptor)."""
        known = self._procs.get(pid)
        try:
            if known is not None:
                changes = read_changes(pid, known.descriptor, self._proc_root,
                                       self._locator.memory)
                if changes.generation == known.generation:
                    return changes.duty
            d = read_descriptor(pid, self._proc_root, self._locator, mappings)
        except DescriptorError as exc:  # the process vanished, or lies
            self._fail(pid, "descriptor_unreadable", str(exc), drop=False)
            return None
        if known is not None and known.generation == d.generation:
            return d.duty
        why = _unsupported(d)
        if why:
            self._fail(pid, "unsupported_runtime", why, drop=True)
            return None
        # Stubs stay on stacks after deactivate(): keep walking what exists.
        active = d.active or (known is not None and known.active)
        if active:
            # ABI 2: the walker checks the duty cycle's `paused` word first.
            paused_addr = d.address + PAUSED_OFFSET if d.duty is not None else 0
            record = layout.ChainProc(tls_offset=d.tls_offset, stub_stride=d.stub_stride,
                                      record_self=d.record_self_offset,
                                      paused_addr=paused_addr)
            try:
                self._maps.install(pid, WALKER, record, d.arenas)
            except MapFull as exc:
                self._fail(pid, "map_full", str(exc), drop=True)
                return None
        self._last_error.pop(pid, None)
        self._procs[pid] = ChainProcess(generation=d.generation, arenas=d.arenas,
                                        active=active, descriptor=d)
        if d.duty is not None and active and self.duty.track(pid, d.address):
            # Its first estimate and duty cycle now, not at the next refresh.
            self.duty.update(pid, d.duty)
            return None  # updated already
        return d.duty

    def report(self, pid: int) -> ModeReport | None:
        proc = self._procs.get(pid)
        if proc is not None and proc.active:
            d = proc.descriptor
            return ModeReport(self.name, f"trampoline runtime {d.runtime_version} (ABI "
                              f"{d.abi_version}, Python {d.python_version}), {d.stub_count} "
                              f"stubs in {len(d.arenas)} arenas, chain head at thread pointer "
                              f"{d.tls_offset:+d}")
        if pid in self._last_error:
            reason, detail = self._last_error[pid]
            hint = ("reading another process's memory needs CAP_SYS_PTRACE"
                    if reason == "descriptor_unreadable" else
                    "upgrade tramprof to a version that knows this runtime")
            return ModeReport(FP, f"trampoline runtime loaded but its chain is not walked: "
                              f"{reason}: {detail}", hint)
        if proc is not None:
            return ModeReport(FP, "the trampoline runtime is loaded but not active (call "
                              "tramprof_trampolines.activate() or set TRAMPROF_TRAMPOLINES=1)")
        return None
