"""Per-process state keyed by process identity, at most one per pid.

The daemon caches expensive per-process state (symbol tables). It must never
hand one process's state to another that reuses its pid, must rebuild it after
an exec (new address space), and must free it on exit, or memory grows with
process churn. Lifecycle events (``procfs.events``) drive it; this table is
the single owner of the state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from tramprof.model import ProcessGone
from tramprof.procfs.events import ProcessEvent
from tramprof.procfs.identity import ExecSignature, ProcessIdentity, ProcStat, read_stat

_log = logging.getLogger(__name__)

T = TypeVar("T")
G = TypeVar("G")


@dataclass(slots=True)
class _Entry(Generic[T]):
    start_ticks: int
    value: T
    signature: ExecSignature | None


class ProcessTable(Generic[T]):
    """Per-process state keyed by :class:`ProcessIdentity`, at most one per pid.

    State is created lazily (``get_or_create``) and only ever dropped by
    events, so a late, lost or reordered event costs at most a rebuild,
    never a mix-up: creation checks in /proc that the pid still belongs to
    the requested identity, after reading what the state is built from.

    * exit: the pid's state is dropped;
    * exec: the state is dropped (new address space) and rebuilt on demand,
      unless it was built after that exec: events are applied late (after
      the next drain), and state built meanwhile for the new image (a
      process looked at on its first sample) has the exec signature /proc
      shows now;
    * fork: nothing (a stale entry under a reused pid is replaced on the
      next ``get_or_create`` and removed by ``resync``);
    * ``resync()``: drops entries whose process is gone, whose pid was
      reused, or whose exec signature changed. Call it after an event source
      overrun and periodically as a backstop (a process whose leader thread
      exited first dies without a process-level exit event).

    ``on_drop(identity, value)`` is called for every entry removed, to
    release resources. Not thread-safe: use it from the daemon's loop; only
    ``len()`` may be read from other threads.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        on_drop: Callable[[ProcessIdentity, T], None] | None = None,
    ) -> None:
        self._proc_root = proc_root
        self._on_drop = on_drop
        self._entries: dict[int, _Entry[T]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, identity: object) -> bool:
        if not isinstance(identity, ProcessIdentity):
            return False
        entry = self._entries.get(identity.pid)
        return entry is not None and entry.start_ticks == identity.start_ticks

    def identities(self) -> list[ProcessIdentity]:
        return [ProcessIdentity(pid, e.start_ticks) for pid, e in self._entries.items()]

    def pids(self) -> set[int]:
        """The pids of the processes held: what the loop asks for at each wake
        (a set of ints, not an identity object per process: ~1 ms less a
        wake with a thousand held)."""
        return set(self._entries)

    def values(self) -> list[T]:
        """The state of every process held."""
        return [entry.value for entry in self._entries.values()]

    def get(self, pid: int, start_ticks: int) -> T | None:
        """The state of exactly this process, if held; never reads /proc."""
        entry = self._entries.get(pid)
        if entry is None or entry.start_ticks != start_ticks:
            return None
        return entry.value

    def get_current(self, pid: int) -> T | None:
        """The state held for ``pid``, whichever process instance it belongs to
        (there is at most one); never reads /proc."""
        entry = self._entries.get(pid)
        return entry.value if entry is not None else None

    def get_or_create(self, pid: int, start_ticks: int, gather: Callable[[], G],
                      build: Callable[[ProcStat, G], T]) -> T:
        """The state of process (pid, start_ticks), made if needed: ``gather``
        reads what the state needs from /proc by pid, one stat read then
        checks that the pid still belongs to that process, alive, and
        ``build`` makes the state from what was gathered and that stat (its
        comm is the process's name: one read fewer per new process).

        One check, after the reads, is enough: the identity was observed (a
        sample, an event, a /proc read) before they began, and a process
        holds its pid from its start to its death, so one found alive under
        that identity after the reads held the pid throughout them: what was
        gathered is its own. Raises ProcessGone, building and keeping nothing,
        when the process is not there any more: exited, a zombie, or its pid
        now belongs to another process (what was gathered is then dropped).
        Exceptions from ``gather`` and ``build`` propagate and nothing is stored.
        """
        entry = self._entries.get(pid)
        if entry is not None:
            if entry.start_ticks == start_ticks:
                return entry.value
            if entry.start_ticks > start_ticks:
                raise ProcessGone(pid, "its pid has been reused by a newer process")
        gathered = gather()
        stat = self._check_alive(ProcessIdentity(pid, start_ticks))
        if entry is not None:
            self._remove(pid)  # the pid was reused: the older process is dead
        value = build(stat, gathered)
        self._entries[pid] = _Entry(start_ticks, value, stat.exec_signature)
        return value

    def _check_alive(self, identity: ProcessIdentity) -> ProcStat:
        stat = read_stat(identity.pid, self._proc_root)
        if stat.start_ticks != identity.start_ticks:
            raise ProcessGone(
                identity.pid,
                f"pid now belongs to a process started at tick {stat.start_ticks}, "
                f"not {identity.start_ticks}",
            )
        if stat.is_dead:
            raise ProcessGone(identity.pid, "exited (zombie)")
        return stat

    def on_event(self, event: ProcessEvent) -> None:
        """Apply a lifecycle event (see the class docstring)."""
        if event.kind == "exit" or (event.kind == "exec" and not self._current(event.pid)):
            self.drop(event.pid)

    def _current(self, pid: int) -> bool:
        """Whether the state held for ``pid`` was built for the image it runs
        now (same process, same visible exec signature)."""
        entry = self._entries.get(pid)
        if entry is None or entry.signature is None:
            return False
        try:
            stat = read_stat(pid, self._proc_root)
        except (ProcessGone, OSError, ValueError):
            return False
        return (stat.start_ticks == entry.start_ticks and not stat.is_dead
                and stat.exec_signature == entry.signature)

    def drop(self, pid: int) -> bool:
        """Drop whatever state is held for ``pid``; True if there was some."""
        return self._remove(pid)

    def resync(self) -> int:
        """Reconcile with /proc after lost events; returns how many entries went."""
        dropped = 0
        for pid, entry in list(self._entries.items()):
            try:
                stat = read_stat(pid, self._proc_root)
            except ProcessGone:
                stale = True
            except (OSError, ValueError) as e:
                _log.debug("resync: cannot check pid %d, keeping its state: %s", pid, e)
                continue
            else:
                # A known exec signature that changed or vanished means an exec
                # (see ProcPollingSource); an unknown one cannot tell.
                stale = (
                    stat.start_ticks != entry.start_ticks
                    or stat.is_dead
                    or (entry.signature is not None and stat.exec_signature != entry.signature)
                )
            if stale and self._remove(pid):
                dropped += 1
        return dropped

    def clear(self) -> None:
        """Drop everything (shutdown)."""
        for pid in list(self._entries):
            self._remove(pid)

    def _remove(self, pid: int) -> bool:
        entry = self._entries.pop(pid, None)
        if entry is None:
            return False
        self._release(ProcessIdentity(pid, entry.start_ticks), entry.value)
        return True

    def _release(self, identity: ProcessIdentity, value: T) -> None:
        if self._on_drop is None:
            return
        try:
            self._on_drop(identity, value)
        except Exception:
            # A failing cleanup must not keep stale state alive or stop a resync.
            _log.exception("releasing the state of process %d failed", identity.pid)
