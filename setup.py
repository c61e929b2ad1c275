"""The compiled part of the daemon (everything else is in pyproject.toml).

``tramprof._speedups`` is optional: without a C compiler or Python's
headers the package installs without it and names stacks in Python alone.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tramprof._speedups", ["daemon/tramprof/_speedups.c"],
                             optional=True)])
