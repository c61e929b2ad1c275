"""tramprof: a continuous CPU profiler that unwinds through JIT trampolines."""

from importlib.metadata import PackageNotFoundError, version

try:
    # One source: the version in pyproject.toml, as installed.
    __version__ = version("tramprof")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
