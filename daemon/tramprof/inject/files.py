"""Files the target must open, placed in its own file system and removed.

The target may live in its own mount namespace with its own ``/tmp``: the
directory is made under ``/proc/PID/root/tmp``, reached one component at a
time without following symlinks (a container cannot point ``/tmp`` at a
host directory). It gets a random name (``mkdir`` fails rather than reuse
anything), mode 0700, and is owned by the target's uid and gid, like every
file in it: created with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600. Only the
target (and root) can read them, nobody else can swap them. Removal goes
through the same directory descriptor, so it never touches anything else.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from dataclasses import dataclass, field

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: Where files go, as the target sees it.
TMP = "tmp"
PREFIX = "tramprof-inject-"


class PlacementError(OSError):
    """The files could not be placed safely in the target's root."""


@dataclass
class PlacedDir:
    """A private directory in the target's root; ``path`` is the target's view."""

    path: str
    _fd: int        # the directory itself
    _tmp_fd: int    # the target's /tmp, to remove the directory from
    _names: list[str] = field(default_factory=list)
    _subdirs: list[str] = field(default_factory=list)

    def write(self, name: str, data: bytes, uid: int, gid: int) -> str:
        """Create ``name`` (may contain one sub-directory: ``dir/file``) with
        ``data``; returns its path as the target sees it."""
        parent_fd, base = self._parent(name, uid, gid)
        try:
            fd = os.open(base, _NEW_FILE_FLAGS, 0o600, dir_fd=parent_fd)
        finally:
            if parent_fd != self._fd:
                os.close(parent_fd)
        try:
            os.fchmod(fd, 0o600)
            os.fchown(fd, uid, gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        self._names.append(name)
        return f"{self.path}/{name}"

    def _parent(self, name: str, uid: int, gid: int) -> tuple[int, str]:
        parts = name.split("/")
        if len(parts) == 1:
            return self._fd, name
        if len(parts) != 2 or not all(parts) or ".." in parts:
            raise ValueError(f"file name must be FILE or DIR/FILE: {name!r}")
        sub, base = parts
        if sub not in self._subdirs:
            os.mkdir(sub, 0o700, dir_fd=self._fd)
            self._subdirs.append(sub)
            sub_fd = os.open(sub, _DIR_FLAGS, dir_fd=self._fd)
            os.fchown(sub_fd, uid, gid)
        else:
            sub_fd = os.open(sub, _DIR_FLAGS, dir_fd=self._fd)
        return sub_fd, base

    def read(self, name: str, limit: int = 4096) -> bytes:
        """The first ``limit`` bytes of a file the target may have written to
        (a regular file, not followed if it became a link)."""
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         dir_fd=self._fd)
        except OSError:
            return b""
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return b""
            return os.pread(fd, limit, 0)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Delete every file made here and the directory; safe to call twice."""
        if self._fd < 0:
            return
        for name in reversed(self._names):
            parent = name.rpartition("/")[0]
            with contextlib.suppress(OSError):
                if parent:
                    sub_fd = os.open(parent, _DIR_FLAGS, dir_fd=self._fd)
                    try:
                        os.unlink(name.rpartition("/")[2], dir_fd=sub_fd)
                    finally:
                        os.close(sub_fd)
                else:
                    os.unlink(name, dir_fd=self._fd)
        for sub in self._subdirs:
            with contextlib.suppress(OSError):
                os.rmdir(sub, dir_fd=self._fd)
        fd, self._fd = self._fd, -1
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(self.path.rpartition("/")[2], dir_fd=self._tmp_fd)
        os.close(self._tmp_fd)


def make_private_dir(pid: int, uid: int, gid: int, proc_root: str = "/proc") -> PlacedDir:
    """A new directory under the target's ``/tmp`` (mode 0700, owned by uid:gid)."""
    root = f"{proc_root}/{pid}/root"
    try:
        root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise PlacementError(exc.errno, f"cannot open {root}: {exc.strerror}") from exc
    try:
        try:
            tmp_fd = os.open(TMP, _DIR_FLAGS, dir_fd=root_fd)
        except OSError as exc:
            raise PlacementError(exc.errno, f"the process has no usable /tmp "
                                 f"({exc.strerror}; a symlink is not followed)") from exc
    finally:
        os.close(root_fd)
    try:
        for _attempt in range(8):
            name = PREFIX + secrets.token_hex(8)
            try:
                os.mkdir(name, 0o700, dir_fd=tmp_fd)
            except FileExistsError:
                continue
            fd = os.open(name, _DIR_FLAGS, dir_fd=tmp_fd)
            try:
                os.fchmod(fd, 0o700)
                os.fchown(fd, uid, gid)
            except OSError:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=tmp_fd)
                raise
            placed = PlacedDir(path=f"/{TMP}/{name}", _fd=fd, _tmp_fd=tmp_fd)
            tmp_fd = -1
            return placed
        raise PlacementError(0, "could not find a free directory name in the target's /tmp")
    except OSError as exc:
        if isinstance(exc, PlacementError):
            raise
        raise PlacementError(exc.errno, f"cannot create a directory in the target's /tmp: "
                             f"{exc.strerror}") from exc
    finally:
        if tmp_fd >= 0:
            os.close(tmp_fd)
