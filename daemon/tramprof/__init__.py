"""tramprof: a continuous CPU profiler that unwinds through JIT trampolines."""

__version__ = "0.1.0"
