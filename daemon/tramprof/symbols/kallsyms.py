"""Kernel address -> function name, from ``/proc/kallsyms``.

kallsyms lists symbol *starts* only, no sizes, so a function is taken to end
where the next symbol (of any type) begins. Non-text symbols are kept as
terminators so that an address in data, or past ``_etext``, resolves to
nothing instead of to the last function before it. The last symbol of a
region (core kernel or one module) cannot be bounded by its successor,
because regions are far apart, so it is given at most 4 KiB, rounded up to a
page boundary (perf's heuristic).

The table is two flat containers (``array('Q')`` of starts and a list of
names, ``None`` for "no function here") so ~200k symbols cost a few MB, and
a lookup is one ``bisect``.
"""

from __future__ import annotations

import threading
from array import array
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from tramprof.symbols.names import PackedNames

_PAGE = 4096
_TEXT_TYPES = frozenset("tTwW")
# Section-boundary markers that kallsyms lists as text symbols although no
# code follows them; they must end the preceding function, not name a range.
_END_MARKERS = frozenset({"_etext", "_einittext", "_end"})
# Start markers share their address with the first real function; they only
# name a range when nothing better is there.
_START_MARKERS = frozenset({"_stext", "_text", "_sinittext"})


@dataclass(slots=True)
class _Raw:
    addr: int
    region: str  # "" for the core kernel, else the module name
    name: str
    kind: str


def _is_text(sym: _Raw) -> bool:
    if sym.kind not in _TEXT_TYPES:
        return False
    if sym.region:
        return True
    return sym.name not in _END_MARKERS and not sym.name.endswith("_text_end")


def _rank(sym: _Raw) -> tuple[int, int, int, int, int]:
    """Sort key among aliases at one address: smaller is better.

    Section start markers lose to anything else; then perf's choice: strong
    over weak, global over local, fewer leading underscores (``vfs_read`` over
    ``__vfs_read``), then the longer name.
    """
    marker = 1 if sym.name in _START_MARKERS or sym.name.endswith("_text_start") else 0
    weak = 1 if sym.kind in "wW" else 0
    local = 1 if sym.kind.islower() else 0
    underscores = len(sym.name) - len(sym.name.lstrip("_"))
    return (marker, weak, local, underscores, -len(sym.name))


def _display(sym: _Raw) -> str:
    return f"{sym.name} [{sym.region}]" if sym.region else sym.name


class KernelSymbols:
    """Lazily loaded, cached view of ``/proc/kallsyms``.

    Loading happens on first use (``resolve``/``available``/``len``) so that
    constructing the daemon does not pay for it; ``reload`` re-reads the file
    after modules or BPF programs came and went.
    """

    def __init__(self, path: str = "/proc/kallsyms") -> None:
        self._path = path
        self._lock = threading.Lock()
        self._loaded = False
        self._starts: array[int] = array("Q")
        self._names = PackedNames(())
        self._count = 0
        self._reason: str | None = None

    @property
    def path(self) -> str:
        return self._path

    @property
    def available(self) -> bool:
        """True when at least one kernel text symbol with a real address is known."""
        self._ensure_loaded()
        return self._reason is None

    @property
    def unavailable_reason(self) -> str | None:
        """Why ``available`` is False (human-readable), or None when it is True."""
        self._ensure_loaded()
        return self._reason

    def __len__(self) -> int:
        """Number of distinct function addresses in the table."""
        self._ensure_loaded()
        return self._count

    def reload(self) -> None:
        """Forget the parsed table; the next use re-reads the file."""
        with self._lock:
            self._loaded = False

    def resolve(self, addr: int) -> str | None:
        """Name of the kernel function containing ``addr``.

        Core kernel functions come back plain (``vfs_read``), module and BPF
        symbols with their module (``nf_hook_slow [nf_tables]``). Returns None
        for addresses outside any known function or when kallsyms is not
        available.
        """
        if not self._loaded:
            self._ensure_loaded()
        i = bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        return self._names[i]

    def _ensure_loaded(self) -> None:
        if self._loaded:
            return
        with self._lock:
            if self._loaded:
                return
            self._load()
            self._loaded = True

    def _load(self) -> None:
        self._starts = array("Q")
        self._names = PackedNames(())
        self._count = 0
        try:
            with open(self._path, encoding="utf-8", errors="replace") as f:
                raw, zero = _parse_lines(f)
        except OSError as e:
            self._reason = f"cannot read {self._path}: {e.strerror or e}"
            return
        if not raw:
            if zero:
                self._reason = (
                    f"{self._path} shows only zero addresses: kernel.kptr_restrict "
                    "hides them (run as root with CAP_SYSLOG, or set "
                    "kernel.kptr_restrict=0)"
                )
            else:
                self._reason = f"{self._path} lists no symbols"
            return
        self._build(raw)
        self._reason = None if self._count else f"{self._path} lists no text symbols"

    def _build(self, raw: list[_Raw]) -> None:
        raw.sort(key=lambda s: s.addr)
        # One entry per address: the best text alias, or a terminator.
        groups: list[tuple[int, str, str | None]] = []
        i, n = 0, len(raw)
        while i < n:
            j = i + 1
            addr = raw[i].addr
            while j < n and raw[j].addr == addr:
                j += 1
            texts = [s for s in raw[i:j] if _is_text(s)]
            if texts:
                best = min(texts, key=_rank)
                groups.append((addr, best.region, _display(best)))
            else:
                groups.append((addr, raw[i].region, None))
            i = j

        starts = self._starts
        names: list[str | None] = []
        for k, (addr, region, name) in enumerate(groups):
            if name is None:
                if names and names[-1] is None:
                    continue  # consecutive terminators add nothing
                starts.append(addr)
                names.append(None)
                continue
            starts.append(addr)
            names.append(name)
            self._count += 1
            nxt = groups[k + 1] if k + 1 < len(groups) else None
            if nxt is None or nxt[1] != region:
                end = (addr + _PAGE + _PAGE - 1) // _PAGE * _PAGE
                if nxt is None or end < nxt[0]:
                    starts.append(end)
                    names.append(None)
        self._names = PackedNames(names)


def _parse_lines(lines: Iterable[str]) -> tuple[list[_Raw], int]:
    """Parse kallsyms lines into raw records; also count zero-address lines."""
    raw: list[_Raw] = []
    zero = 0
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        try:
            addr = int(parts[0], 16)
        except ValueError:
            continue
        if addr == 0:
            zero += 1
            continue
        region = ""
        if len(parts) >= 4 and parts[3].startswith("[") and parts[3].endswith("]"):
            region = parts[3][1:-1]
        raw.append(_Raw(addr, region, parts[2], parts[1]))
    return raw, zero
