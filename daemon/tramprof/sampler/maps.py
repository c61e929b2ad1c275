"""Per-process unwinding state in the BPF maps: the one writer.

Unwinding modes decide *what* the BPF program needs for a process (a chain
walker's TLS offset, a scan layout) and *where* its stubs are; this module
is the only code that writes it. It takes plain values: the walker's map
name, its ready-made record (a ``sampler.layout`` struct) and the arenas.

Arena pages (``stub_pages``) are shared by the walkers of one process, so
each page is kept while any walker of that process holds it. Every install
is all or nothing: a process that asks for more pages than its cap, or that
finds the map full, is refused with ``MapFull`` and whatever this call had
inserted is removed again, so one process can never leave the maps half
written or crowd out the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
from collections.abc import Iterable, Iterator
from typing import Any

from tramprof.config import DEFAULT_STUB_PAGES
from tramprof.sampler import layout

log = logging.getLogger(__name__)

PAGE = 0x1000


class MapFull(Exception):
    """The process's state does not fit (its cap or the map's size); nothing
    of this install is left in the maps."""


def arena_pages(arenas: Iterable[tuple[int, int]]) -> Iterator[tuple[int, int]]:
    """(page, arena start) of every page of every arena."""
    for start, end in arenas:
        for page in range(start & ~(PAGE - 1), end, PAGE):
            yield page, start


class ProcessMaps:
    """Installs and removes per-process walker state in a loaded program's maps."""

    def __init__(self, bpf: Any, max_pages_per_process: int = DEFAULT_STUB_PAGES) -> None:
        self._bpf = bpf
        self.max_pages_per_process = max_pages_per_process
        # tgid -> walker map name -> pages it holds
        self._held: dict[int, dict[bytes, set[int]]] = {}
        self._records: dict[bytes, type[ctypes.Structure]] = {}
        self._pages = bpf.get_table(b"stub_pages", keytype=layout.StubPage,
                                    leaftype=ctypes.c_uint64)

    @functools.cached_property
    def _stale_chains(self) -> Any:
        # Looked up once: a lookup costs more than reading the map when it
        # is empty (147 µs the first time, 14-23 µs after), and this is
        # read about once a second.
        return self._bpf.get_table(b"stale_chains", keytype=ctypes.c_uint32,
                                   leaftype=ctypes.c_uint8)

    def _table(self, walker: bytes) -> Any:
        return self._bpf.get_table(walker, keytype=ctypes.c_uint32,
                                   leaftype=self._records[walker])

    def pages_held(self, tgid: int) -> int:
        return len(set().union(*self._held.get(tgid, {}).values()))

    def install(self, tgid: int, walker: bytes, record: ctypes.Structure,
                arenas: Iterable[tuple[int, int]]) -> None:
        """Let ``walker`` (its per-process map, e.g. ``b"scan_procs"``) unwind
        ``tgid`` with ``record``; ``arenas`` are added to what it holds."""
        held = self._held.setdefault(tgid, {})
        mine = held.setdefault(walker, set())
        by_any = set().union(*held.values())
        new = [(page, start) for page, start in arena_pages(arenas) if page not in by_any]
        if len(by_any) + len(new) > self.max_pages_per_process:
            self._drop_if_empty(tgid, walker)
            raise MapFull(f"process {tgid} would hold {len(by_any) + len(new)} stub pages "
                          f"(at most {self.max_pages_per_process})")
        inserted: list[int] = []
        try:
            for page, start in new:
                self._pages[layout.StubPage(tgid=tgid, page=page)] = ctypes.c_uint64(start)
                inserted.append(page)
            self._records.setdefault(walker, type(record))
            self._table(walker)[ctypes.c_uint32(tgid)] = record
        except Exception as exc:  # bcc raises plain Exception on E2BIG / ENOMEM
            for page in inserted:
                self._delete_page(tgid, page)
            self._drop_if_empty(tgid, walker)
            raise MapFull(f"process {tgid}: {exc}") from exc
        mine.update(inserted)
        mine.update(page for page, _start in arena_pages(arenas))

    def remove(self, tgid: int, walker: bytes) -> None:
        """Forget ``walker``'s state of ``tgid``; pages no other walker of
        ``tgid`` holds go too."""
        held = self._held.get(tgid, {})
        if walker not in held:
            return
        mine = held.pop(walker)
        with contextlib.suppress(KeyError):
            del self._table(walker)[ctypes.c_uint32(tgid)]
        others = set().union(*held.values())
        for page in mine - others:
            self._delete_page(tgid, page)
        if not held:
            self._held.pop(tgid, None)

    def take_stale_chains(self) -> set[int]:
        """Processes whose chain walk met a stub outside the arenas installed
        for them (``stale_chains``) since the last call; the entries read are
        deleted (one set again meanwhile is lost: the next sample of that
        process sets it again). Two system calls when there are any, one
        when there are none."""
        table = self._stale_chains
        keys = [key for key, _value in table.iter_raw()]
        if keys:
            table.delete_raw(keys)
        return {int.from_bytes(key[:4], "little") for key in keys}

    def _delete_page(self, tgid: int, page: int) -> None:
        with contextlib.suppress(KeyError):
            del self._pages[layout.StubPage(tgid=tgid, page=page)]

    def _drop_if_empty(self, tgid: int, walker: bytes) -> None:
        held = self._held.get(tgid)
        if held is not None and not held.get(walker):
            held.pop(walker, None)
            if not held:
                self._held.pop(tgid, None)
