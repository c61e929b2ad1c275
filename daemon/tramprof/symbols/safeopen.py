"""Open files that an unprivileged process controls, without trusting them.

Runtimes write ``/tmp/perf-PID.map`` and ``/tmp/jit-PID.dump``; anyone who can
write to ``/tmp`` can also put a symlink, a FIFO, a device node or someone
else's file there.  The profiler runs as root, so every open must make sure
it reads a plain file owned by the process it is profiling, never blocks, and
never reads more than a fixed cap.

Refusal reasons are exported as metric label values, so the set is fixed:

``missing``        the file (or a directory on the way) does not exist, or the
                   process is gone
``symlink``        the final component, or any component below ``root``, is a
                   symbolic link
``not_regular``    FIFO, socket, device, directory, ...
``hardlink``       a regular file with more than one link (somebody linked a
                   file they do not control into /tmp)
``foreign_owner``  owned neither by the expected uid nor by root
``permission``     EACCES/EPERM from the kernel
``io_error``       any other OS error (EMFILE, EIO, ENAMETOOLONG, ...)

A file larger than the cap is not refused: callers read only its first
``max_bytes`` bytes.

This is the one opener of files a target process controls: its JIT files
(``open_untrusted``) and the objects it maps, whose paths in
``/proc/PID/maps`` it chooses (``open_mapped_object``).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from typing import BinaryIO, Final

from tramprof.procfs.maps import Mapping, memory_thread

MISSING: Final = "missing"
SYMLINK: Final = "symlink"
NOT_REGULAR: Final = "not_regular"
HARDLINK: Final = "hardlink"
FOREIGN_OWNER: Final = "foreign_owner"
PERMISSION: Final = "permission"
IO_ERROR: Final = "io_error"
#: Last written before the process started: left by an earlier process that
#: had the same pid (set by TailReader, not by open_untrusted).
STALE: Final = "stale"

#: Every reason :func:`open_untrusted` can return, in a stable order.
REFUSAL_REASONS: Final[tuple[str, ...]] = (
    MISSING,
    SYMLINK,
    NOT_REGULAR,
    HARDLINK,
    FOREIGN_OWNER,
    PERMISSION,
    IO_ERROR,
    STALE,
)

# O_NONBLOCK: opening a FIFO without a writer returns at once instead of
# hanging.  O_NOCTTY: a tty planted in /tmp never becomes our terminal.
_FILE_FLAGS: Final = (
    os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
)
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What a reader remembers to notice that a path now names another file."""

    dev: int
    ino: int
    size: int
    #: Last modification; not part of the identity (appends change it).
    mtime_ns: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a file was not opened; ``reason`` is one of :data:`REFUSAL_REASONS`."""

    reason: str
    detail: str = ""


class SafeFile:
    """An open, verified regular file; reads never go past ``limit``.

    ``limit`` is ``min(size at open, max_bytes)``: bytes appended after the
    ``fstat`` are left for the next open, so every read sees one consistent
    snapshot length.
    """

    __slots__ = ("_fd", "capped_bytes", "identity", "limit")

    def __init__(self, fd: int, identity: FileIdentity, max_bytes: int) -> None:
        self._fd = fd
        self.identity = identity
        self.limit = min(identity.size, max(0, max_bytes))
        #: Bytes of the file beyond the cap, which are never read.
        self.capped_bytes = identity.size - self.limit

    def read_at(self, offset: int, length: int) -> bytes:
        """Read up to ``length`` bytes at ``offset``, clipped to ``limit``."""
        end = min(self.limit, offset + length)
        if offset < 0 or end <= offset:
            return b""
        want = end - offset
        first = os.pread(self._fd, want, offset)
        if len(first) == want or not first:
            return first
        # Short read on a regular file: only at EOF (file shrank) or on a
        # signal; collect what is there without looping forever.
        parts = [first]
        got = len(first)
        while got < want:
            more = os.pread(self._fd, want - got, offset + got)
            if not more:
                break
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        """Close the descriptor; safe to call twice."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __enter__(self) -> SafeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refusal_for(err: OSError, what: str) -> Refusal:
    code = err.errno
    if code == errno.ELOOP:
        reason = SYMLINK
    elif code in (errno.ENOENT, errno.ESRCH):
        reason = MISSING
    elif code in (errno.ENOTDIR, errno.ENXIO, errno.ENODEV):
        # ENOTDIR: a component is not a directory; ENXIO: a socket or a
        # device without a driver.
        reason = NOT_REGULAR
    elif code in (errno.EACCES, errno.EPERM):
        reason = PERMISSION
    else:
        reason = IO_ERROR
    return Refusal(reason, f"{what}: {os.strerror(code) if code else err}")


def _refusal_for_component(err: OSError, part: str, dir_fd: int) -> Refusal:
    # O_DIRECTORY|O_NOFOLLOW on a symlink fails with ENOTDIR, not ELOOP.
    if err.errno == errno.ENOTDIR:
        try:
            if stat.S_ISLNK(os.stat(part, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                return Refusal(SYMLINK, f"directory {part!r} is a symbolic link")
        except OSError:
            pass
    return _refusal_for(err, f"directory {part!r}")


def _check_stat(st: os.stat_result, expected_uid: int | None,
                allow_hardlinks: bool = False) -> Refusal | None:
    if stat.S_ISLNK(st.st_mode):
        return Refusal(SYMLINK, "symbolic link")
    if not stat.S_ISREG(st.st_mode):
        return Refusal(NOT_REGULAR, f"file type {stat.S_IFMT(st.st_mode):o}")
    if st.st_nlink > 1 and not allow_hardlinks:
        return Refusal(HARDLINK, f"{st.st_nlink} links")
    if expected_uid is not None and st.st_uid not in (expected_uid, 0):
        return Refusal(FOREIGN_OWNER, f"uid {st.st_uid}, expected {expected_uid}")
    return None


def _split_relative(path: str) -> list[str]:
    parts = [p for p in path.split("/") if p and p != "."]
    if not parts or ".." in parts:
        raise ValueError(f"path under root must be relative and without '..': {path!r}")
    return parts


def open_untrusted(
    path: str,
    expected_uid: int | None,
    max_bytes: int,
    *,
    root: str | None = None,
    allow_hardlinks: bool = False,
) -> SafeFile | Refusal:
    """Open ``path`` for reading only if it is a plain file we may trust.

    Without ``root`` only the last component is protected against symlinks
    (``O_NOFOLLOW``).  With ``root`` (for example ``/proc/PID/root``), the
    root itself is followed -- it is the kernel's link to the process's mount
    namespace -- and ``path`` is resolved below it one component at a time
    with ``O_NOFOLLOW``, so a container cannot point ``/tmp`` at a host
    directory through an absolute symlink.

    A ``stat`` before the open keeps devices and FIFOs from being opened at
    all (opening some devices has side effects); the ``fstat`` of the open
    descriptor is the check that counts.
    """
    dir_fd: int | None = None
    try:
        if root is not None:
            parts = _split_relative(path)
            try:
                dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError as err:
                return _refusal_for(err, "root")
            for part in parts[:-1]:
                try:
                    next_fd = os.open(part, _DIR_FLAGS, dir_fd=dir_fd)
                except OSError as err:
                    return _refusal_for_component(err, part, dir_fd)
                os.close(dir_fd)
                dir_fd = next_fd
            name = parts[-1]
        else:
            name = path
        try:
            pre = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError as err:
            return _refusal_for(err, "lstat")
        refused = _check_stat(pre, expected_uid, allow_hardlinks)
        if refused is not None:
            return refused
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
        except OSError as err:
            return _refusal_for(err, "open")
    finally:
        if dir_fd is not None:
            os.close(dir_fd)
    try:
        st = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        return _refusal_for(err, "fstat")
    refused = _check_stat(st, expected_uid, allow_hardlinks)
    if refused is not None:
        os.close(fd)
        return refused
    return SafeFile(fd, FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns), max_bytes)


# A kernel magic link (/proc/PID/map_files/...) is followed, never blocks.
_MAGIC_LINK_FLAGS: Final = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


def stat_mapped_object(proc: str, m: Mapping) -> os.stat_result | Refusal:
    """The ``stat`` of the object behind one mapping through its kernel link
    (``map_files``), without opening it: one system call, enough to find an
    object already parsed or held for another process."""
    try:
        return os.stat(_map_files_path(proc, m))
    except OSError as err:
        return _refusal_for(err, "stat")


def _map_files_path(proc: str, m: Mapping) -> str:
    return f"{proc}/map_files/{m.start:x}-{m.end:x}"


def open_mapped_object(path: str, *, root: str | None = None,
                       pre: os.stat_result | None = None,
                       ) -> tuple[BinaryIO, os.stat_result] | Refusal:
    """A file a process has mapped (executable, library, runtime extension),
    as a seekable binary file with its ``fstat``.

    With ``root`` (``/proc/PID/root``), ``path`` comes from ``/proc/PID/maps``
    and so is the process's to choose: it is resolved below ``root`` without
    following any symlink, as :func:`open_untrusted` does. Without ``root``,
    ``path`` is a kernel magic link (``/proc/PID/map_files/START-END``), which
    is followed: it always names the object actually mapped (a ``stat``
    through it first, unless the caller made it (``pre``): a mapped device
    is never opened). Either way only a
    regular file is returned, opened without blocking. Owner and link count
    are not checked: libraries are owned by anyone and may be hard-linked.
    """
    if root is not None:
        opened = open_untrusted(path, None, 0, root=root, allow_hardlinks=True)
        if isinstance(opened, Refusal):
            return opened
        fd, opened._fd = opened._fd, -1
    else:
        if pre is None:
            try:
                pre = os.stat(path)
            except OSError as err:
                return _refusal_for(err, "stat")
        if not stat.S_ISREG(pre.st_mode):
            return Refusal(NOT_REGULAR, f"file type {stat.S_IFMT(pre.st_mode):o}")
        try:
            fd = os.open(path, _MAGIC_LINK_FLAGS)
        except OSError as err:
            return _refusal_for(err, "open")
    try:
        st = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        return _refusal_for(err, "fstat")
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return Refusal(NOT_REGULAR, f"file type {stat.S_IFMT(st.st_mode):o}")
    return os.fdopen(fd, "rb"), st


def open_mapping(proc: str, m: Mapping, refusals: list[str] | None = None, *,
                 map_files_stat: os.stat_result | Refusal | None = None) -> BinaryIO | None:
    """The object behind one mapping of a process.

    ``proc`` is ``/proc/PID``. First ``map_files``: the kernel's link to the
    object actually mapped (deleted files and memfds too), three system
    calls; following it needs CAP_CHECKPOINT_RESTORE (or CAP_SYS_ADMIN),
    which the daemon keeps. Without it, ``/proc/PID/root`` + path: the
    container's view of the file, resolved one component at a time (a dozen
    system calls for a library four directories deep; a busy node opens a
    few objects for each of its 20 new processes a second), where an inode
    check rejects a file replaced since it was mapped. None: neither way
    opened it (the reasons are appended to ``refusals``).
    ``map_files_stat``: what :func:`stat_mapped_object` already found.
    """
    candidates: list[tuple[str, str | None]] = [(_map_files_path(proc, m), None)]
    if not m.is_deleted and not m.is_memfd:
        candidates.append((m.path, f"{proc}/root"))
    for path, root in candidates:
        opened: tuple[BinaryIO, os.stat_result] | Refusal
        if root is not None:
            opened = open_mapped_object(path, root=root)
        elif isinstance(map_files_stat, Refusal):
            opened = map_files_stat
        else:
            opened = open_mapped_object(path, pre=map_files_stat)
        if isinstance(opened, Refusal):
            if refusals is not None:
                refusals.append(f"{root or ''}{path}: {opened.reason} {opened.detail}".rstrip())
            continue
        f, st = opened
        if root is not None and m.inode and st.st_ino != m.inode:
            f.close()
            if refusals is not None:
                refusals.append(f"{root}{path}: replaced since it was mapped")
            continue
        return f
    return None


def open_process_mapping(proc_root: str, pid: int, m: Mapping,
                         refusals: list[str] | None = None) -> BinaryIO | None:
    """``open_mapping`` through ``/proc/PID`` or, when that opens nothing
    because the main thread has exited while others run on (its entry then
    has no root and no map_files), through a running thread's entry."""
    f = open_mapping(f"{proc_root}/{pid}", m, refusals)
    if f is not None:
        return f
    thread = memory_thread(pid, proc_root)
    if thread is None:
        return None
    return open_mapping(f"{proc_root}/{pid}/task/{thread}", m, refusals)
