"""cffi (API mode) builder for tramprof_trampolines._runtime.

The C lives beside this file: tramprof.h (one definition of the descriptor
and the API; its CDEF region is handed to cdef() verbatim) and tramprof.c.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from cffi import FFI

HERE = Path(__file__).resolve().parent
VERSION = "0.1.0"


def _cdef() -> str:
    header = (HERE / "tramprof.h").read_text()
    match = re.search(r"/\* CDEF BEGIN \*/(.*?)/\* CDEF END \*/", header, re.S)
    if match is None:
        raise RuntimeError("tramprof.h: CDEF markers are missing")
    return match.group(1)


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "tramprof_trampolines._runtime",
    '#include "tramprof.h"\n',
    sources=[os.path.relpath(HERE / "tramprof.c")],
    include_dirs=[str(HERE)],
    # The runtime reads CPython's internal frame headers: no limited API, and
    # no .abi3 file name that would let another CPython version load it.
    define_macros=[("_CFFI_NO_LIMITED_API", None), ("TRAMPROF_VERSION", f'"{VERSION}"')],
    py_limited_api=False,
    extra_compile_args=["-O2", "-fno-strict-aliasing", "-Wall", "-Wno-unused-function", "-pthread"],
    extra_link_args=["-pthread"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
