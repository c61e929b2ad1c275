"""Exceptions of the symbolization layer.

The base class, ``SymbolizationError``, and ``ProcessGone`` are shared by
every stage and live in ``tramprof.model``; what is here is the ELF reader's
own, whose ``reason`` ends up in the failure counters.
"""

from __future__ import annotations

from tramprof.model import SymbolizationError


class ElfError(SymbolizationError):
    """A file could not be used as an ELF object.

    ``reason`` is a short machine-readable label (``"not_elf"`` or
    ``"malformed_elf"``) so the failure can be counted without parsing the
    message.
    """

    def __init__(self, message: str, reason: str = "malformed_elf") -> None:
        self.reason = reason
        super().__init__(message)
