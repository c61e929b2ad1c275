"""Unprivileged attacker processes: each mode does one thing a hostile tenant
can do to a profiler that reads its files, names and memory, then spins so
that it is sampled, and runs until killed. Prints "ready" when set up."""

import ctypes
import mmap
import os
import random
import sys
import time


def spin_forever() -> None:
    print("ready", flush=True)
    x = 0
    while True:
        x = (x * 31 + 7) % 1000003


def run_inside(mapping: mmap.mmap, offset: int) -> None:
    """Spin, in a thread, on a `jmp .` at ``offset`` of an executable mapping,
    so that samples land in it and the daemon has to name that object."""
    import threading
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping)) + offset
    loop = ctypes.CFUNCTYPE(None)(address)  # ctypes drops the GIL while it runs
    threading.Thread(target=loop, daemon=True).start()


JMP_SELF = b"\xeb\xfe"
RWX = mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC


def anon_exec() -> mmap.mmap:
    """Anonymous executable memory: makes the process a candidate for the
    trampoline modes and gives its frames to the perf map reader."""
    return mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                     prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)


def lying_descriptor(library: str) -> None:
    import threading
    lib = ctypes.CDLL(library)
    threading.Thread(target=lib.spin, daemon=True).start()  # ctypes drops the GIL
    spin_forever()


def fifo_perf_map() -> None:
    # The FIFOs first: the daemon looks for the perf map within a millisecond
    # of the first sample in the JIT code.
    for path in (f"/tmp/perf-{os.getpid()}.map", f"/tmp/jit-{os.getpid()}.dump"):
        try:
            os.mkfifo(path, 0o644)
        except FileExistsError:  # left by an earlier process of ours with this pid
            os.unlink(path)
            os.mkfifo(path, 0o644)
    code = anon_exec()
    code.write(JMP_SELF)
    run_inside(code, 0)  # JIT code to name: the daemon looks for the perf map
    spin_forever()


def hostile_names(directory: str) -> None:
    """Maps files whose names carry a fake [vdso] line after a \\r, bytes that
    are not UTF-8, and terminal escapes."""
    fake_vdso = "7f0000100000-7f0025900000 r-xp 00000000 00:00 0            [vdso]"
    names = [f"lib\r{fake_vdso}".encode(), b"lib\xff\xfe\x1b[31mred\x85.so",
             "lib\u2028[heap]".encode()]
    keep = []
    for name in names:
        path = os.path.join(directory.encode(), name)
        with open(path, "wb") as f:
            f.write(JMP_SELF + b"\0" * 4094)
        with open(path, "r+b") as f:
            keep.append(mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE, prot=RWX))
        run_inside(keep[-1], 0)
    spin_forever()


def random_names(children: str) -> None:
    """Forks children with random thread names, each spinning a little."""
    libc = ctypes.CDLL(None)
    print("ready", flush=True)
    while True:
        running = []
        for _ in range(int(children)):
            pid = os.fork()
            if pid == 0:
                name = "".join(random.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
                libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME
                end = time.monotonic() + 0.05
                while time.monotonic() < end:
                    pass
                os._exit(0)
            running.append(pid)
        for pid in running:
            os.waitpid(pid, 0)


def elf_bomb(path: str) -> None:
    """Maps, executable, an ELF file claiming a million section headers
    (sparse: it costs nothing on disk)."""
    import struct
    shoff = 4096
    with open(path, "wb") as f:
        ident = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8)
        f.write(ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, shoff, 0, 64, 56, 0, 64,
                                    0, 0))
        f.seek(0x80)
        f.write(JMP_SELF)
        f.seek(shoff)
        f.write(struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 1_000_000, 0, 0, 0, 0))
        f.truncate(shoff + 64 * 1_000_000)
    with open(path, "r+b") as f:
        keep = mmap.mmap(f.fileno(), 4096, flags=mmap.MAP_PRIVATE, prot=RWX)
    run_inside(keep, 0x80)
    spin_forever()


MODES = {"descriptor": lying_descriptor, "fifo": fifo_perf_map, "names": hostile_names,
         "forknames": random_names, "elfbomb": elf_bomb}

if __name__ == "__main__":
    MODES[sys.argv[1]](*sys.argv[2:])
