"""What the daemon remembers per process: its name and symbolizers.

State is keyed by (pid, start time), so a reused pid never sees the symbols
of the process that had it before, and within one process by exec id (the
kernel's ``self_exec_id``, carried by every sample), so samples taken before
an exec are never named with the new image's symbols.

Lifecycle events are applied one drain late: samples of a process that just
exited are still in the kernel buffer and need its state once more.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from tramprof.processes import ProcessEvent, ProcessTable
from tramprof.procinfo import ProcessIdentity, boottime_ns_to_ticks, read_comm
from tramprof.symbols.elf import ElfCache
from tramprof.symbols.errors import ProcessGone, SymbolizationError
from tramprof.symbols.usersyms import ProcessSymbolizer, SymbolizationStats

log = logging.getLogger(__name__)

# Distinct addresses remembered per process image; bounds memory for
# processes with huge, ever-changing JIT code.
MAX_CACHED_ADDRESSES = 65536
# Exec generations kept per process (a process that execs in a loop).
MAX_IMAGES = 2


@dataclass
class ProcessImage:
    """One executable image of a process: its symbolizer and an address cache."""

    symbolizer: ProcessSymbolizer | None
    names: dict[int, str] = field(default_factory=dict)

    def resolve(self, addr: int) -> str:
        name = self.names.get(addr)
        if name is None:
            name = self.symbolizer.resolve(addr) if self.symbolizer else "[unknown]"
            if len(self.names) >= MAX_CACHED_ADDRESSES:
                self.names.clear()
            self.names[addr] = name
        return name


@dataclass
class ProcessState:
    name: str
    images: dict[int, ProcessImage] = field(default_factory=dict)


class ProcessRegistry:
    """Per-process symbolization state with pid-reuse- and exec-safe keys."""

    def __init__(self, proc_root: str = "/proc", elf_cache: ElfCache | None = None,
                 failures: Counter[str] | None = None,
                 anon_resolver_factory: Callable[[int], Callable[..., str | None] | None]
                 | None = None) -> None:
        self.proc_root = proc_root
        self.elf_cache = elf_cache or ElfCache()
        self.failures: Counter[str] = failures if failures is not None else Counter()
        self.symbolization_stats = SymbolizationStats()
        self._anon_factory = anon_resolver_factory
        self._table: ProcessTable[ProcessState] = ProcessTable(proc_root)
        self._pending: list[ProcessEvent] = []

    def __len__(self) -> int:
        return len(self._table)

    def identities(self) -> list[ProcessIdentity]:
        return self._table.identities()

    def identity(self, tgid: int, start_boottime_ns: int) -> ProcessIdentity:
        return ProcessIdentity(tgid, boottime_ns_to_ticks(start_boottime_ns))

    def _state(self, identity: ProcessIdentity, fallback_name: str) -> ProcessState:
        def create() -> ProcessState:
            try:
                name = read_comm(identity.pid, self.proc_root)
            except (OSError, SymbolizationError):
                name = fallback_name
            return ProcessState(name=name or fallback_name)

        return self._table.get_or_create(identity.pid, identity.start_ticks, create)

    def image(self, tgid: int, start_boottime_ns: int, exec_id: int,
              fallback_name: str) -> tuple[str, ProcessImage | None]:
        """Process name and the image that was running at ``exec_id``; no image
        when the process exited before the daemon ever looked at it."""
        identity = self.identity(tgid, start_boottime_ns)
        try:
            state = self._state(identity, fallback_name)
        except ProcessGone:
            self.failures["process_exited"] += 1
            return fallback_name, None
        image = state.images.get(exec_id)
        if image is None:
            if state.images and exec_id < max(state.images):
                # An image the process has left before we first looked at it.
                self.failures["image_replaced_by_exec"] += 1
                image = ProcessImage(symbolizer=None)
            else:
                image = ProcessImage(symbolizer=self._symbolizer(identity.pid))
            state.images[exec_id] = image
            while len(state.images) > MAX_IMAGES:
                del state.images[min(state.images)]
        return state.name, image

    def warm(self, tgid: int, start_boottime_ns: int, exec_id: int) -> None:
        """Build a process image's symbolizer right away (it was just sampled
        for the first time and may not live until the next drain)."""
        identity = self.identity(tgid, start_boottime_ns)
        try:
            state = self._state(identity, "")
        except ProcessGone:
            return
        if exec_id not in state.images:
            symbolizer = self._symbolizer(identity.pid)
            if symbolizer is not None:
                symbolizer.preload()
            state.images[exec_id] = ProcessImage(symbolizer=symbolizer)
            while len(state.images) > MAX_IMAGES:
                del state.images[min(state.images)]

    def _symbolizer(self, pid: int) -> ProcessSymbolizer | None:
        anon = self._anon_factory(pid) if self._anon_factory else None
        try:
            return ProcessSymbolizer(pid, self.elf_cache, self.symbolization_stats,
                                     proc_root=self.proc_root, anon_resolver=anon)
        except SymbolizationError as exc:
            self.failures["process_gone"] += 1
            log.debug("no symbolizer for pid %d: %s", pid, exc)
            return None

    def defer(self, events: list[ProcessEvent]) -> None:
        """Queue lifecycle events; they take effect after the next drain."""
        self._pending.extend(events)

    def apply_pending(self) -> None:
        events, self._pending = self._pending, []
        for event in events:
            self._table.on_event(event)

    def resync(self) -> None:
        self._table.resync()
