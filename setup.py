"""The compiled part of the daemon (everything else is in pyproject.toml).

``tramprof._speedups`` is optional: without a C compiler or Python's
headers the package installs without it and names stacks in Python alone.
``TRAMPROF_PURE_PYTHON=1`` leaves it out on purpose: a wheel for any
CPython from 3.11 on, not only the one it is built with.
"""

import os

from setuptools import Extension, setup

SPEEDUPS = Extension("tramprof._speedups", ["daemon/tramprof/_speedups.c"], optional=True)

setup(ext_modules=[] if os.environ.get("TRAMPROF_PURE_PYTHON") == "1" else [SPEEDUPS])
