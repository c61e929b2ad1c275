"""Exceptions of the symbolization layer.

One base class so callers that only want "symbolization failed, degrade the
frame" can catch a single type, while the subclasses carry the reason that
ends up in the failure counters.
"""

from __future__ import annotations


class SymbolizationError(Exception):
    """Base class for every error raised by ``tramprof.symbols``."""


class ProcessGone(SymbolizationError):
    """The process exited (or became a zombie) before we could read it.

    Short-lived processes are the normal case for a fleet profiler, so this is
    an expected condition that callers count rather than log.
    """

    def __init__(self, pid: int, detail: str = "") -> None:
        self.pid = pid
        message = f"process {pid} is gone"
        super().__init__(f"{message}: {detail}" if detail else message)


class ElfError(SymbolizationError):
    """A file could not be used as an ELF object.

    ``reason`` is a short machine-readable label (``"not_elf"`` or
    ``"malformed_elf"``) so the failure can be counted without parsing the
    message.
    """

    def __init__(self, message: str, reason: str = "malformed_elf") -> None:
        self.reason = reason
        super().__init__(message)
