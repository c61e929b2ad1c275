"""Target for out-of-process checks: activates the runtime, runs known
functions, then blocks in outer -> middle -> inner (main thread) and in
thread_outer -> thread_inner (a second thread) until stdin closes.

Prints one JSON line: pid, each thread's fs base (arch_prctl), the perf-map
names expected on each chain (innermost first), stub addresses of known
functions; then "ready".
"""

import ctypes
import json
import os
import sys
import threading

import tramprof_trampolines as t

ARCH_GET_FS = 0x1003
SYS_arch_prctl = 158
libc = ctypes.CDLL(None, use_errno=True)
info = {"pid": os.getpid(), "python": sys.version.split()[0]}
thread_ready = threading.Event()
read_fd, write_fd = os.pipe()


def qualname(code):
    return getattr(code, "co_qualname", code.co_name)


def fs_base():
    value = ctypes.c_ulong()
    if libc.syscall(SYS_arch_prctl, ARCH_GET_FS, ctypes.byref(value)) != 0:
        raise OSError(ctypes.get_errno(), "arch_prctl")
    return value.value


def stack_names():
    names = []
    f = sys._getframe(1)
    while f is not None:
        names.append(f"py::{qualname(f.f_code)}:{f.f_code.co_filename}")
        f = f.f_back
    return names


def thread_inner():
    info["thread_fs"] = fs_base()
    info["thread_names"] = stack_names()
    thread_ready.set()
    os.read(read_fd, 1)  # blocks without the GIL


def thread_outer():
    thread_inner()


def inner():
    info["main_fs"] = fs_base()
    info["main_names"] = stack_names()
    info["calibration"] = [t._debug_calibration_rounds(), t._debug_calibration_dropped()]
    info["stubs"] = {name: t.stub_address(fn.__code__)
                     for name, fn in (("inner", inner), ("middle", middle), ("outer", outer))}
    thread_ready.wait()
    print(json.dumps(info), flush=True)
    print("ready", flush=True)
    sys.stdin.read()  # blocks until the test closes stdin
    os.write(write_fd, b"x")


def middle():
    inner()


def outer():
    middle()


if __name__ == "__main__":
    t.activate()  # a no-op when started with TRAMPROF_TRAMPOLINES=1
    th = threading.Thread(target=thread_outer, name="blocked")
    th.start()
    outer()
    th.join()
