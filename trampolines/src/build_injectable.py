"""Build the injectable runtime (tramprof.c + inject_module.c, no cffi) for
one CPython minor version:

    python3 build_injectable.py INCLUDE_DIR [INCLUDE_DIR...] -o _runtime-cp311.so

INCLUDE_DIR: the version's headers (Debian: /usr/include/python3.X and
/usr/include, whose x86_64-linux-gnu/python3.X holds pyconfig.h). Build it
on the oldest glibc you support (Debian 11 here): the result then loads in
containers with any newer one. Runs on Python 3.6+.
"""

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def main(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("include", nargs="+")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--cc", default=os.environ.get("CC", "gcc"))
    args = parser.parse_args(argv)
    command = [args.cc, "-shared", "-fPIC", "-pthread", "-O2", "-fno-strict-aliasing", "-Wall",
               "-Wno-unused-function", "-DTRAMPROF_VERSION=\"%s\"" % VERSION, "-I", HERE]
    for include in args.include:
        command += ["-I", include]
    command += [os.path.join(HERE, "tramprof.c"), os.path.join(HERE, "inject_module.c"),
                "-o", args.output]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
