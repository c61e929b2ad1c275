"""Start-up helpers for tramprof_trampolines that must not import the
package (its cffi extension cannot load in isolated sub-interpreters).

tramprof_trampolines.pth calls :func:`autostart` when TRAMPROF_TRAMPOLINES
is set (and not "0"). Start-up must never fail because of the profiler:
problems are reported on stderr and the program runs without trampolines.
Sub-interpreters also run site and .pth files (e.g. 3.12+
``concurrent.interpreters``); they are skipped silently, since the runtime
hooks the main interpreter only.
"""

import sys


def in_main_interpreter():
    """True/False when the interpreter can tell, None if it cannot."""
    for name in ("_interpreters", "_xxsubinterpreters"):
        try:
            module = __import__(name)
        except ImportError:
            continue
        current = module.get_current()
        if isinstance(current, tuple):  # 3.13+: (id, whence)
            current = current[0]
        return int(current) == 0  # the main interpreter's id is always 0
    return None


def autostart():
    if in_main_interpreter() is False:
        return
    try:
        import tramprof_trampolines

        tramprof_trampolines.activate()
    except Exception as exc:
        sys.stderr.write("tramprof_trampolines: not activated: %s\n" % (exc,))
