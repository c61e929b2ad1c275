"""The unwinding-mode protocol and the registry that asks every mode.

Frame-pointer walking ("fp") covers every process and needs no state. A
process whose stubs can be found gets one trampoline mode on top: a mode
decides from what the process exposes (its mappings, memory, perf map)
whether it can unwind it, installs per-process state in the BPF maps through
a ``MapWriter``, follows the process after every drain, and forgets it when
it exits. The sampler records the frames its walker finds; the merge needs
the mode's stub arenas to interleave them with the native frames.

``profiler``, ``doctor`` and the metrics talk to ``UnwindModes`` only and
never name a mode: a new mode is one module here plus its BPF walker.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from tramprof.model import FrameSource
from tramprof.procfs.maps import Mapping
from tramprof.sampler import layout
from tramprof.unwind.arenas import Arenas

log = logging.getLogger(__name__)

#: The mode of a process no trampoline mode unwinds.
FP = "fp"
#: A new candidate is followed on every wake of the loop (at least this
#: often, seconds) for NEWCOMER_SECONDS after it was taken, at most
#: NEWCOMER_LIMIT of them per mode each time.
FOLLOW_EVERY = 0.1
NEWCOMER_SECONDS = 5.0
NEWCOMER_LIMIT = 32


class MapWriter(Protocol):
    """Where modes install per-process state (``sampler.maps.ProcessMaps``).
    ``install`` raises ``sampler.maps.MapFull`` (all or nothing) when the
    state does not fit."""

    def install(self, tgid: int, walker: bytes, record: ctypes.Structure,
                arenas: Iterable[tuple[int, int]]) -> None: ...

    def remove(self, tgid: int, walker: bytes) -> None: ...

    def take_stale_chains(self) -> set[int]:
        """Processes whose chain walk met a stub outside the arenas installed
        for them since the last call (their runtime made an arena since)."""
        ...


@dataclass(frozen=True)
class ModeReport:
    """What a mode says about one process, for ``doctor``."""

    mode: str      # the mode that unwinds it ("fp" when this one does not)
    detail: str    # one sentence: what was found
    problem: str = ""  # non-empty: why the mode could not be used, and what to do


class UnwindMode(Protocol):
    """One way of recovering trampoline frames."""

    #: Label value of the mode in metrics and ``doctor``.
    name: str
    #: The BPF counter of samples this mode's walker recovered frames in.
    sample_counter: layout.Counter

    def consider(self, pid: int, mappings: Sequence[Mapping]) -> None:
        """A process image was sampled for the first time: take it on if its
        mappings show this mode's stubs (or a runtime that will make them)."""

    def refresh(self, live: set[int], full: bool = True,
                sampled: Container[int] | None = None) -> None:
        """After a drain (``full``): follow new stubs of the processes in
        ``live`` and forget every other process; ``sampled``, if known, holds
        the processes the drain had samples of, and a mode whose walker
        reports what it could not walk may look only at those. Also about
        once a second between drains (not ``full``): a mode may then look
        only at what may have changed since, and forgetting may wait."""

    def follow(self, live: set[int]) -> None:
        """Between refreshes, on every wake of the loop: look again only at
        what is about to change (a young process whose runtime activates or
        whose code fills new stub arenas, a table build that finished), at a
        cost that does not grow with the processes the mode holds. Forgets
        nothing."""

    def following(self) -> bool:
        """True while ``follow`` has something to look at within
        FOLLOW_EVERY seconds."""

    def forget(self, pid: int) -> None:
        """Drop the process and its BPF state."""

    def unwinds(self, pid: int) -> bool:
        """True while the BPF walker of this mode records ``pid``'s frames."""

    def unwound(self) -> set[int]:
        """Every pid ``unwinds`` is true for (a refresh asks for all at once)."""

    def arenas(self, pid: int) -> Arenas | None:
        """Where ``pid``'s stubs are, for the merge (None: not unwound here)."""

    def report(self, pid: int) -> ModeReport | None:
        """What this mode found about ``pid`` (None: nothing to say)."""

    def errors(self) -> Counter[str]:
        """Processes refused or failed, by reason (cumulative)."""


class NativeMode(UnwindMode, Protocol):
    """A mode that replaces the frame-pointer walk of native frames (under
    whichever trampoline mode a process also has); it learns from samples
    which code needs it."""

    def note_code(self, pid: int, sources: Iterable[FrameSource | None]) -> None:
        """Where the frames of one drained stack of ``pid`` (a process this
        mode was asked to consider) run, as they were named."""

    def close(self) -> None:
        """Stop background work."""


class UnwindModes:
    """The trampoline modes in a fixed order of preference (the first that
    unwinds a process keeps it, and the later ones let it go), and the
    native modes, which every process may have on top."""

    def __init__(self, modes: Sequence[UnwindMode], native: Sequence[NativeMode] = ()) -> None:
        self.modes = tuple(modes)
        self.native = tuple(native)
        names = [m.name for m in (*self.modes, *self.native)]
        if FP in names or len(set(names)) != len(names):
            raise ValueError(f"mode names must be distinct and not {FP!r}: {names}")

    @property
    def names(self) -> tuple[str, ...]:
        return (*(m.name for m in (*self.modes, *self.native)), FP)

    def consider(self, pid: int, mappings: Sequence[Mapping]) -> None:
        for native in self.native:
            native.consider(pid, mappings)
        for mode in self.modes:
            mode.consider(pid, mappings)
            if mode.unwinds(pid):
                return

    def note_code(self, pid: int, sources: Iterable[FrameSource | None]) -> None:
        for native in self.native:
            native.note_code(pid, sources)

    def refresh(self, live: set[int], full: bool = True,
                sampled: Container[int] | None = None) -> None:
        taken: set[int] = set()
        for mode in self.modes:
            mode.refresh(live - taken, full, sampled)
            taken |= mode.unwound() & live
        for native in self.native:
            native.refresh(live, full, sampled)

    def follow(self, live: set[int]) -> None:
        for mode in (*self.modes, *self.native):
            mode.follow(live)

    def following(self) -> bool:
        return any(mode.following() for mode in (*self.modes, *self.native))

    def forget(self, pid: int) -> None:
        for mode in (*self.modes, *self.native):
            mode.forget(pid)

    def _owner(self, pid: int) -> UnwindMode | None:
        return next((m for m in self.modes if m.unwinds(pid)), None)

    def mode_of(self, pid: int) -> str:
        owner = self._owner(pid)
        return owner.name if owner is not None else FP

    def arenas(self, pid: int) -> Arenas | None:
        owner = self._owner(pid)
        return owner.arenas(pid) if owner is not None else None

    def report(self, pid: int) -> ModeReport:
        """The trampoline report (below), with what the native modes found."""
        found = self._trampoline_report(pid)
        for native in self.native:
            extra = native.report(pid)
            if extra is None:
                continue
            mode = found.mode if found.mode != FP or extra.mode == FP else extra.mode
            if found.mode != FP and extra.mode != FP:
                mode = f"{found.mode}+{extra.mode}"
            found = ModeReport(mode, f"{found.detail}; {extra.detail}",
                               "; ".join(p for p in (found.problem, extra.problem) if p))
        return found

    def _trampoline_report(self, pid: int) -> ModeReport:
        """The owning mode's report, else the first mode with something to say
        (e.g. a refusal), else plain frame-pointer walking."""
        owner = self._owner(pid)
        if owner is not None:
            found = owner.report(pid)
            if found is not None:
                return found
        for mode in self.modes:
            found = mode.report(pid)
            if found is not None:
                return found
        return ModeReport(FP, "frame-pointer walk (frames of code built without frame "
                          "pointers are skipped)")

    def errors(self) -> Counter[tuple[str, str]]:
        """(mode, reason) -> processes refused or failed."""
        out: Counter[tuple[str, str]] = Counter()
        for mode in (*self.modes, *self.native):
            for reason, count in mode.errors().items():
                out[(mode.name, reason)] += count
        return out


class DryRunMaps:
    """A ``MapWriter`` (and table writer) that installs nothing: ``doctor``
    asks the modes what they would do for a process without loading the BPF
    program."""

    def load_rows(self, rows: bytes) -> int:
        return 0

    def unload_rows(self, first_row: int) -> None:
        pass

    def set_unwind_process(self, tgid: int, mappings: Sequence[layout.UnwindMapping]) -> None:
        pass

    def remove_unwind_process(self, tgid: int) -> None:
        pass

    def install(self, tgid: int, walker: bytes, record: ctypes.Structure,
                arenas: Iterable[tuple[int, int]]) -> None:
        pass

    def remove(self, tgid: int, walker: bytes) -> None:
        pass

    def take_stale_chains(self) -> set[int]:
        return set()


class Newcomers:
    """Candidates a mode took in the last NEWCOMER_SECONDS. A refresh looks
    at a process about once a second at most; a newcomer's
    runtime activates milliseconds after the mode first saw it, and its
    first stubs fill new arenas while its code runs for the first time (a
    stub in an arena not yet installed ends the walk there; the chain
    walker reports that, scan mode has no such sign). A command that
    lives three seconds would lose a third of its samples waiting for the
    refresh."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._since: dict[int, float] = {}
        self._now = now

    def add(self, pid: int) -> None:
        self._since.setdefault(pid, self._now())

    def discard(self, pid: int) -> None:
        self._since.pop(pid, None)

    def __bool__(self) -> bool:
        return bool(self._since)

    def due(self, live: set[int], candidates: Container[int]) -> list[int]:
        """The newest NEWCOMER_LIMIT in ``live`` to look at now; the ones no
        longer ``candidates`` (refused, forgotten) or too old leave."""
        now = self._now()
        for pid, since in list(self._since.items()):
            if now - since > NEWCOMER_SECONDS or pid not in candidates:
                del self._since[pid]
        newest = sorted((p for p in self._since if p in live), key=self._since.__getitem__,
                        reverse=True)
        return newest[:NEWCOMER_LIMIT]
