"""Folded stacks (``comm;root;...;leaf COUNT``), the flame-graph exchange format.

Frame names may contain anything the programs put in their symbol tables;
the two characters that break the format (``;`` separates frames, a newline
ends a record) are replaced so every line stays parseable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TextIO


def clean_frame(name: str) -> str:
    return name.replace(";", ":").replace("\n", " ").replace("\r", " ") or "[empty]"


def folded_line(comm: str, frames: Iterable[str], count: int) -> str:
    parts = [clean_frame(comm), *(clean_frame(f) for f in frames)]
    return f"{';'.join(parts)} {count}"


def write_folded(stacks: Mapping[tuple[str, ...], int], out: TextIO) -> None:
    """Write ``(comm, frame, ...) -> count`` as folded lines, largest first."""
    for key, count in sorted(stacks.items(), key=lambda kv: (-kv[1], kv[0])):
        comm, *frames = key
        out.write(folded_line(comm, frames, count) + "\n")


def parse_folded(text: str) -> Counter[tuple[str, ...]]:
    """Inverse of write_folded; used by tests and by tools that merge files."""
    result: Counter[tuple[str, ...]] = Counter()
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            raise ValueError(f"not a folded stack line: {line[:200]!r}")
        result[tuple(stack.split(";"))] += int(count)
    return result
