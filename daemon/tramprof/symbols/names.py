"""The names of a symbol table, packed into one bytes object.

A symbol table holds tens of thousands of names (a kernel ~120,000, node
~60,000) of which a profile ever shows a few thousand. As ``str`` objects
they cost ~75 bytes each: a kernel's alone took ~9 MiB of the daemon's
heap. Packed, a name costs its UTF-8 bytes and a 4-byte end offset; it
becomes a ``str`` the first time it is looked up and stays that one object,
so every stack that names it shares it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

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
