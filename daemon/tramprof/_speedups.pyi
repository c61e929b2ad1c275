# Types of the C extension built from _speedups.c (see there).
from typing import Any

def merge_trampolines(ips: tuple[int, ...], sps: tuple[int, ...],
                      trampoline_frames: tuple[tuple[int, int], ...],
                      starts: list[int], ends: list[int], incomplete: bool,
                      gap: str) -> list[int | str] | None: ...
def cached_answers(addresses: list[int | str], found: dict[int, Any],
                   jit_found: dict[int, Any]) -> tuple[list[Any], int, int] | None: ...
def split_pairs(pairs: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]] | None: ...
