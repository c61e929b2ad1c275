"""Target for test_runtime_files: prints {"pid": ...}, then waits for a line
on stdin (the test plants files at /tmp/perf-<pid>.map or /tmp/jit-<pid>.dump
meanwhile), activates the runtime (jitdump per TRAMPROF_TRAMPOLINES_JITDUMP),
runs a plain function and one whose code carries control characters in its
name and file name, optionally forks (argv "fork"), prints one JSON line and
waits until stdin closes (so the test can read the descriptor)."""

import json
import os
import sys
import time

import tramprof_trampolines as t

HOSTILE_NAME = "evil\n7f0000000000 42 py::forged:/etc/passwd\r\t\x1b[2J\x00\x7f\x85\u2028end"
HOSTILE_FILE = "/tmp/x\ny\x1b]0;title\x07.py"


def plain():
    return 1


def hostile():
    return 2


def main():
    print(json.dumps({"pid": os.getpid()}), flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    t.activate()
    elapsed = time.monotonic() - started
    code = hostile.__code__
    changes = {"co_name": HOSTILE_NAME, "co_filename": HOSTILE_FILE}
    if hasattr(code, "co_qualname"):
        changes["co_qualname"] = HOSTILE_NAME
    hostile.__code__ = code.replace(**changes)
    plain()
    hostile()
    report = {"pid": os.getpid(), "activate_seconds": elapsed, "active": t.is_active(),
              "map": t.perf_map_path(), "jitdump": t.jitdump_path(),
              "plain": t.stub_address(plain.__code__),
              "hostile": t.stub_address(hostile.__code__),
              "hostile_name": HOSTILE_NAME, "hostile_file": HOSTILE_FILE}
    if sys.argv[1:] == ["fork"]:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            child = {"pid": os.getpid(), "map": t.perf_map_path(), "active": t.is_active()}
            os.write(w, json.dumps(child).encode())
            os._exit(0)
        os.close(w)
        report["child"] = json.loads(os.read(r, 65536).decode())
        os.close(r)
        report["child_status"] = os.waitpid(pid, 0)[1]
    print(json.dumps(report), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
