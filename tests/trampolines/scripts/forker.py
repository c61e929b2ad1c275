"""os.fork() with the runtime active: the child must write its own perf map
holding every stub it inherited plus its new ones. Prints one JSON line."""

import json
import os
import sys

import tramprof_trampolines as t


def before_fork():
    return sum(range(10))


def child_only():
    return "child"


def parent_after_fork():
    return "parent"


def main():
    t.activate()
    before_fork()
    parent_map = t.perf_map_path()
    size_at_fork = os.stat(parent_map).st_size
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        from tramprof_trampolines._runtime import lib

        child_only()
        report = {"map": t.perf_map_path(), "descriptor_pid": lib.tramprof_descriptor.pid,
                  "pid": os.getpid(), "active": t.is_active(),
                  "child_only": t.stub_address(child_only.__code__),
                  "before_fork": t.stub_address(before_fork.__code__)}
        os.write(w, json.dumps(report).encode())
        os._exit(0)
    os.close(w)
    child = json.loads(os.read(r, 65536).decode())
    _, status = os.waitpid(pid, 0)
    parent_after_fork()
    print(json.dumps({"parent_map": parent_map, "size_at_fork": size_at_fork,
                      "child": child, "status": status, "pid": os.getpid(),
                      "child_only_in_parent": t.stub_address(child_only.__code__),
                      "parent_after_fork": t.stub_address(parent_after_fork.__code__)}))


if __name__ == "__main__":
    sys.exit(main())
