"""Runs with TRAMPROF_TRAMPOLINES=1 TRAMPROF_TRAMPOLINES_JITDUMP=1: spins in
known functions for a while (so perf can sample them), prints one JSON line."""

import json
import os
import sys
import time

import tramprof_trampolines as t


def leaf(n):
    return sum(i * i for i in range(n))


def spin(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        leaf(2000)


if __name__ == "__main__":
    spin(float(sys.argv[1]) if len(sys.argv) > 1 else 0.05)
    print(json.dumps({"pid": os.getpid(), "jitdump": t.jitdump_path(),
                      "map": t.perf_map_path(), "leaf": t.stub_address(leaf.__code__)}))
