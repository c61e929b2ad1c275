"""What a reader really holds in memory, as tracemalloc sees it."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def traced_bytes(build: Callable[[], T]) -> tuple[T, int]:
    """(what ``build`` returns, bytes it still holds once garbage is collected)."""
    gc.collect()
    tracemalloc.start()
    try:
        built = build()
        gc.collect()
        held, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return built, held
