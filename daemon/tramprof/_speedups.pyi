# Types of the C extension built from _speedups.c (see there).
from typing import Any

def merge_trampolines(ips: tuple[int, ...], sps: tuple[int, ...],
                      trampoline_frames: tuple[tuple[int, int], ...],
                      starts: list[int], ends: list[int], incomplete: bool,
                      gap: str) -> list[int | str] | None: ...
def cached_answers(addresses: list[int | str], found: dict[int, Any],
                   jit_found: dict[int, Any]) -> tuple[list[Any], int, int] | None: ...
def cached_stack(ips: tuple[int, ...], sps: tuple[int, ...],
                 trampoline_frames: tuple[tuple[int, int], ...], starts: list[int],
                 ends: list[int], incomplete: bool, stop_gap: bool, gap: str,
                 found: dict[int, Any], jit_found: dict[int, Any],
                 shared: tuple[list[int], list[int], list[tuple[str, int, Any]],
                               dict[tuple[str, int], str], int, Any] | None,
                 head: tuple[str, ...], tail_names: tuple[str, ...],
                 tail_sources: tuple[Any, ...]
                 ) -> tuple[tuple[str, ...], tuple[Any, ...], int, int] | list[int | str] \
                    | None: ...
def split_pairs(pairs: list[tuple[Any, Any]]) -> tuple[list[Any], list[Any]] | None: ...
def mapping_starts(sources: tuple[Any, ...] | list[Any]) -> set[int] | None: ...
def parse_maps(data: bytes, mapping_type: type[Any]) -> list[Any] | None: ...
def shared_answers(addresses: list[int | str], answers: list[Any], los: list[int],
                   his: list[int], entries: list[tuple[str, int, Any]],
                   names: dict[tuple[str, int], str], found: dict[int, Any], max_found: int,
                   frame_source: Any) -> int | None: ...
