"""python -m tramprof_trampolines [--hook-only] (script.py | -m module) [args...]"""

import os
import runpy
import sys

USAGE = "usage: python -m tramprof_trampolines [--hook-only] (script.py | -m module) [args...]\n"


def main(argv: list) -> int:
    mode = None
    if argv[:1] == ["--hook-only"]:
        mode = "hook-only"
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(USAGE) if argv else sys.stderr.write(USAGE)
        return 0 if argv else 2
    if argv[0] == "-m" and len(argv) < 2:
        sys.stderr.write(USAGE)
        return 2

    from . import TrampolineError, activate

    try:
        activate(mode)
    except TrampolineError as exc:
        sys.stderr.write("tramprof_trampolines: %s\n" % (exc,))
        return 1
    if argv[0] == "-m":
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
