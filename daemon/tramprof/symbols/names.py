"""Names held compactly: a symbol table's packed into one bytes object, and
the names runtimes write shared between the processes that write them.

A symbol table holds tens of thousands of names (a kernel ~120,000, node
~60,000) of which a profile ever shows a few thousand. As ``str`` objects
they cost ~75 bytes each: a kernel's alone took ~9 MiB of the daemon's
heap. Packed, a name costs its UTF-8 bytes and a 4-byte end offset; it
becomes a ``str`` the first time it is looked up and stays that one object,
so every stack that names it shares it.

Perf maps and jitdumps are written per process, but processes running the
same code write the same names (40 node processes on one host: 157,000
entries, 5,300 distinct names). ``SHARED_NAMES`` hands each distinct name out
as one object, so it is held once whichever files name it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Final

_ENCODING = ("utf-8", "surrogatepass")  # any str round-trips
#: Bytes per entry besides the name's own: the end offset.
OFFSET_BYTES = 4


class PackedNames:
    """A read-only sequence of names; ``None`` (a gap) is stored as an empty
    name, so names themselves are never empty."""

    __slots__ = ("_blob", "_decoded", "_ends")

    def __init__(self, names: Iterable[str | None]) -> None:
        parts: list[bytes] = []
        ends = array("I")
        total = 0
        for name in names:
            if name:
                encoded = name.encode(*_ENCODING)
                parts.append(encoded)
                total += len(encoded)
            ends.append(total)
        self._blob = b"".join(parts)
        self._ends = ends
        self._decoded: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, index: int) -> str | None:
        name = self._decoded.get(index)
        if name is not None:
            return name
        if index < 0:
            index += len(self._ends)
        end = self._ends[index]  # IndexError as a list would raise
        begin = self._ends[index - 1] if index else 0
        if begin == end:
            return None
        name = self._decoded[index] = self._blob[begin:end].decode(*_ENCODING)
        return name

    def count(self) -> int:
        """Entries that are names, not gaps."""
        previous, named = 0, 0
        for end in self._ends:
            named += end != previous
            previous = end
        return named

    def packed_bytes(self) -> int:
        """Memory of the packed names (the decoded ones come on top)."""
        return len(self._blob) + OFFSET_BYTES * len(self._ends)


#: Distinct names a ``NameSharer`` remembers before it starts afresh: its
#: dictionary costs ~60 bytes a name (~4 MiB at most), beyond the memory of
#: the names themselves, which their readers count.
MAX_SHARED_NAMES: Final = 1 << 16


class NameSharer:
    """Hands out one ``str`` object per distinct name.

    Unlike ``sys.intern``, it is bounded: a process writing millions of
    distinct names (a symbol budget bounds what readers keep, not what an
    intern table has seen) only makes it start afresh once it holds more
    than ``max_names``, which drops its table; names handed out before stay
    valid, just not shared with later ones.
    """

    __slots__ = ("_max_names", "_names")

    def __init__(self, max_names: int = MAX_SHARED_NAMES) -> None:
        self._max_names = max_names
        self._names: dict[str, str] = {}

    def share(self, names: list[str]) -> list[str]:
        """``names`` with each one replaced by the object handed out before."""
        known = self._names
        shared = list(map(known.setdefault, names, names))
        if len(known) > self._max_names:
            self.clear()
        return shared

    def one(self, name: str) -> str:
        """``name`` as handed out before."""
        return self.share([name])[0]

    def clear(self) -> None:
        """Start afresh: later names are not shared with earlier ones."""
        self._names = {}

    def __len__(self) -> int:
        return len(self._names)


#: The one the perf map and jitdump readers use.
SHARED_NAMES: Final = NameSharer()
