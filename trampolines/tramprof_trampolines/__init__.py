"""tramprof-trampolines: per-function machine-code stubs for CPython.

Once activated, every Python function runs under its own small stub of
machine code (a PEP 523 eval-frame hook routes each frame through it). Each
stub is named in ``/tmp/perf-<pid>.map`` like CPython's ``-X perf`` stubs
(``py::<qualname>:<filename>``), and pushes a ``{prev, self}`` record onto a
per-thread chain whose head is a TLS slot at a fixed offset from the thread
pointer. ``tramprof`` walks that chain from BPF; the layout is the stable ABI
described in ``ABI.md`` and published by the ``tramprof_descriptor`` symbol.

    import tramprof_trampolines
    tramprof_trampolines.activate()

or ``python -m tramprof_trampolines script.py`` or ``TRAMPROF_TRAMPOLINES=1``.
"""

from __future__ import annotations

import os
import sys
import types
from typing import List, Optional

from _tramprof_trampolines_boot import in_main_interpreter

from ._cffi_preload import preload_cffi_backend

preload_cffi_backend()

from ._runtime import ffi, lib  # noqa: E402

__all__ = ["TrampolineError", "activate", "deactivate", "is_active", "jitdump_path", "mode",
           "perf_map_path", "stub_address"]
__version__ = "0.1.0"

MODES = {"stubs": 1, "hook-only": 2}
_ERRLEN = 512
_fork_hook_registered = False


class TrampolineError(RuntimeError):
    """The runtime could not be activated or deactivated."""


def _after_fork_child() -> None:
    err = ffi.new("char[]", _ERRLEN)
    if lib.tramprof_after_fork_child(err, _ERRLEN) != 0:
        sys.stderr.write("tramprof_trampolines: fork child: %s\n"
                         % ffi.string(err).decode(errors="replace"))


def activate(mode: Optional[str] = None, jitdump: Optional[bool] = None) -> None:
    """Install the eval-frame hook in this interpreter (idempotent).

    *mode* is ``"stubs"`` (default; ``TRAMPROF_TRAMPOLINES_MODE`` overrides it
    when *mode* is None) or ``"hook-only"`` (the hook calls the default
    evaluator directly, no stubs: for measuring where the cost lives).
    *jitdump* (default: ``TRAMPROF_TRAMPOLINES_JITDUMP=1``) also writes
    ``/tmp/jit-<pid>.dump`` with a code and unwind-info (.eh_frame) record per
    stub, for ``perf record -k 1`` + ``perf inject --jit``.
    Raises TrampolineError if another eval-frame function (a debugger, a
    JIT, CPython's own ``-X perf``) is installed: it is never replaced.
    The perf map and jitdump are created exclusively (mode 0600); if their
    path is taken by something that is not a stale file of ours (a FIFO, a
    symlink, another user's file...), a warning goes to stderr and the
    runtime stays active without that file (see README "Files it writes").
    """
    global _fork_hook_registered
    if mode is None:
        mode = os.environ.get("TRAMPROF_TRAMPOLINES_MODE") or "stubs"
    if jitdump is None:
        jitdump = os.environ.get("TRAMPROF_TRAMPOLINES_JITDUMP", "") not in ("", "0")
    if mode not in MODES:
        raise ValueError("mode must be one of %s, not %r" % (sorted(MODES), mode))
    if in_main_interpreter() is False:
        raise TrampolineError("only the main interpreter can be hooked, not a sub-interpreter")
    trampoline_active = getattr(sys, "is_stack_trampoline_active", None)
    if trampoline_active is not None and trampoline_active():
        raise TrampolineError(
            "CPython's own perf trampoline is active (-X perf, PYTHONPERFSUPPORT or "
            "sys.activate_stack_trampoline); refusing to replace it")
    err = ffi.new("char[]", _ERRLEN)
    if lib.tramprof_activate(MODES[mode], int(bool(jitdump)), err, _ERRLEN) != 0:
        raise TrampolineError(ffi.string(err).decode(errors="replace"))
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_after_fork_child)
        _fork_hook_registered = True


def deactivate() -> None:
    """Restore the default evaluator. Stubs stay mapped (running frames
    return through them); activate() again reuses them."""
    err = ffi.new("char[]", _ERRLEN)
    if lib.tramprof_deactivate(err, _ERRLEN) != 0:
        raise TrampolineError(ffi.string(err).decode(errors="replace"))


def is_active() -> bool:
    return bool(lib.tramprof_is_active())


def mode() -> Optional[str]:
    """The active mode, or None."""
    value = lib.tramprof_mode()
    for name, number in MODES.items():
        if number == value:
            return name
    return None


def perf_map_path() -> Optional[str]:
    """The perf map this process writes, once stubs were activated; None
    if its path was taken by a file that is not ours (see activate())."""
    buf = ffi.new("char[]", 256)
    if lib.tramprof_perf_map_path(buf, 256) != 0:
        return None
    return ffi.string(buf).decode()


def jitdump_path() -> Optional[str]:
    """The jitdump file this process writes, if jitdump mode is on and its
    path was free (or held a stale file of ours)."""
    buf = ffi.new("char[]", 256)
    if lib.tramprof_jitdump_path(buf, 256) != 0:
        return None
    return ffi.string(buf).decode()


def stub_address(code: types.CodeType) -> Optional[int]:
    """Start address of the stub assigned to *code*, None if it has none yet."""
    if not isinstance(code, types.CodeType):
        raise TypeError("expected a code object")
    address = lib.tramprof_stub_for_code(ffi.cast("void *", id(code)))
    return address or None


def _debug_chain(limit: int = 4096) -> List[int]:
    """Stub addresses on the calling thread's chain, innermost first (the
    first entry is this function's own stub when stubs are active)."""
    out = ffi.new("uint64_t[]", limit)
    n = lib.tramprof_debug_chain(out, limit)
    return [out[i] for i in range(n)]


def _debug_calibration_rounds() -> int:
    """Rounds the runtime has measured its cost per call in (ABI.md section 8)."""
    return int(lib.tramprof_calibration_rounds())


def _debug_calibration_dropped() -> int:
    """Rounds dropped because the thread moved to another CPU during them."""
    return int(lib.tramprof_calibration_dropped())
