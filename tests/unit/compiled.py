"""The daemon's compiled part for the tests that compare it with the Python
code it stands for: the module, or None, and the mark that skips without it."""

from __future__ import annotations

import pytest

try:
    from tramprof import _speedups
except ImportError:
    _speedups = None  # type: ignore[assignment]

needs_speedups = pytest.mark.skipif(
    _speedups is None, reason="tramprof._speedups is not built (make setup builds it: gcc, "
                              "python3-dev)")
