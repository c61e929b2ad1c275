"""Creates unwind-table chunk maps once the daemon has given up CAP_BPF.

Creating a BPF map needs CAP_BPF, and the daemon drops it as soon as its
program is loaded (``commands.privileges``); yet unwind tables are loaded
lazily, whenever a new object shows up in samples. So, while it still holds
the capability, the daemon starts this small child. The child keeps CAP_BPF
and nothing else, takes no parameters: each byte it reads makes it create
one empty row chunk (an array map of the fixed chunk shape) and pass the
descriptor back over the socket (SCM_RIGHTS). A compromised daemon can make
it create chunk maps and nothing more. It exits when the socket closes.

Chunk memory is still bounded by the daemon's ``unwind_table_bytes``: it
asks only for chunks within the budget, and the kernel frees a chunk once
its last reference (the slot in ``unwind_chunks``) is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import socket
import subprocess
import sys

from tramprof.sampler import layout
from tramprof.sampler.btf import libbpf

_BPF_MAP_TYPE_ARRAY = 2
_ROW_BYTES = ctypes.sizeof(layout.UnwindRow)
_CAP_BPF = 39
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_REQUEST = b"c"
_OK = b"k"
#: Seconds the daemon waits for one chunk before giving up on the child.
REPLY_TIMEOUT = 5.0


def create_chunk_map() -> int:
    """A new, zeroed row chunk; raises OSError (EPERM without CAP_BPF)."""
    lib = libbpf()
    lib.bpf_map_create.restype = ctypes.c_int
    lib.bpf_map_create.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32,
                                   ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p]
    fd = lib.bpf_map_create(_BPF_MAP_TYPE_ARRAY, b"tp_unwind_rows", 4, _ROW_BYTES,
                            layout.UNWIND_CHUNK_ROWS, None)
    if fd < 0:
        raise OSError(-fd, f"creating an unwind chunk: {os.strerror(-fd)}")
    return int(fd)


class ChunkMaker:
    """The daemon's end: starts the child, asks it for chunks."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tramprof.sampler.chunkmaker", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL)
        finally:
            theirs.close()
        ours.settimeout(REPLY_TIMEOUT)
        self._sock = ours

    def create(self) -> int:
        """One new chunk's descriptor (the caller closes it)."""
        try:
            self._sock.sendall(_REQUEST)
            reply, fds, _flags, _addr = socket.recv_fds(self._sock, 16, 1)
        except OSError as exc:
            raise OSError(errno.EPIPE, f"the chunk maker is not answering: {exc}") from exc
        if reply != _OK or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            code = reply[1] if len(reply) > 1 else errno.EIO
            raise OSError(code, f"the chunk maker could not create a chunk: "
                                f"{os.strerror(code)}")
        return fds[0]

    def close(self) -> None:
        self._sock.close()
        try:
            self._child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._child.kill()
            self._child.wait()


def _keep_only_cap_bpf() -> None:
    """Give up every capability but CAP_BPF, for good (best effort: without
    CAP_SETPCAP the bounding set stays, the effective set still shrinks)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap != _CAP_BPF:
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    data = (Data * 2)()
    data[_CAP_BPF // 32].effective = data[_CAP_BPF // 32].permitted = 1 << (_CAP_BPF % 32)
    libc.capset(ctypes.byref(Header(_LINUX_CAPABILITY_VERSION_3, 0)), data)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def serve(sock: socket.socket) -> None:
    while sock.recv(16):
        try:
            fd = create_chunk_map()
        except OSError as exc:
            sock.sendall(b"e" + bytes([min(exc.errno or errno.EIO, 255)]))
            continue
        try:
            socket.send_fds(sock, [_OK], [fd])
        finally:
            os.close(fd)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    with contextlib.suppress(OSError):
        _keep_only_cap_bpf()
    with contextlib.suppress(OSError):  # the daemon is gone
        serve(sock)


if __name__ == "__main__":
    main(sys.argv[1:])
