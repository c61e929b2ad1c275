"""Whether the daemon's compiled part (``_speedups.c``) was built.

``compiled`` is the extension module, or None: the package was installed
without a C compiler or Python's headers (or with ``TRAMPROF_PURE_PYTHON=1``)
and the per-frame passes of naming a stack and the parse of a process's maps
run in Python alone, with the same results. The one place that decides it,
for the modules that use the passes (read at each call: setting it to None
turns them off, as the benchmark that compares the two does) and for what
reports them (``tramprof_build_info``, ``doctor``).
"""

from __future__ import annotations

__all__ = ["compiled", "naming_passes"]

try:
    from tramprof import _speedups as compiled
except ImportError:
    compiled = None  # type: ignore[assignment]


def naming_passes() -> str:
    """How the per-frame passes of naming run: "compiled" or "python"."""
    return "python" if compiled is None else "compiled"
