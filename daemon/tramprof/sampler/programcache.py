"""Compiled program images kept across restarts of the daemon.

Compiling the BPF program takes seconds and, in the compiler child, ~150 MB
of memory; its result depends only on the source, the compiler flags (map
sizes, kernel field offsets), bcc and the kernel. So once compiled, the
program's image (``sampler.image``) is stored under a key made of all of
those, and the next start on the same kernel with the same source loads it
directly: no compiler child, no clang. A kernel, bcc or tramprof upgrade
changes the key and the program is compiled once more.

The directory is the daemon's own state (systemd's ``CacheDirectory=``, a
host path on Kubernetes): whoever can write an image there can make the
daemon load any BPF program. So an image is only read from a directory and
a file that belong to this user or to root and that no one else can write,
opened without following a symbolic link, and of bounded size. A damaged or
refused image is logged, removed and compiled anew; a cache that cannot be
read or written never stops the daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tempfile
from collections.abc import Sequence
from importlib.util import find_spec

from tramprof.sampler.compiler import LoadRequest
from tramprof.sampler.image import IMAGE_FORMAT, ProgramImage

log = logging.getLogger(__name__)

_PREFIX = "program-"
_SUFFIX = ".json"
_MAX_IMAGE_BYTES = 16 << 20
#: Images kept: the newest few (one per kernel or version in use lately).
KEEP_IMAGES = 4


class CacheRefused(OSError):
    """The directory or the file is not one to trust."""


def bcc_version() -> str:
    """bcc's version, read from its package without importing it (importing
    bcc maps LLVM)."""
    spec = find_spec("bcc")
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(path) as f:
            found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", f.read(4096))
    except OSError:
        return ""
    return found.group(1) if found else ""


def _headers_digest(cflags: Sequence[str]) -> str:
    """Every ``*.h`` of the source's own include directories (an upgrade
    that changes only a header must not load the old program)."""
    digest = hashlib.sha256()
    for directory in (flag[2:] for flag in cflags if flag.startswith("-I")):
        try:
            names = sorted(name for name in os.listdir(directory) if name.endswith(".h"))
        except OSError:
            names = []
        for name in names:
            path = os.path.join(directory, name)
            digest.update(f"{path}\0{_file_digest(path)}\0".encode())
    return digest.hexdigest()


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return ""
    return digest.hexdigest()


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read(4096).strip()
    except OSError:
        return ""


def cache_key(request: LoadRequest, btf_path: str) -> str:
    """What the compiled program depends on, hashed: the source, the headers
    it can include from its ``-I`` directories, the flags, the programs asked
    for, bcc, and the running kernel (its build, BTF and possible CPUs, which
    size the per-CPU maps)."""
    uname = os.uname()
    identity = {
        "format": IMAGE_FORMAT,
        "request": request.to_json(),
        "headers": _headers_digest(request.cflags),
        "bcc": bcc_version(),
        "kernel": [uname.release, uname.version, uname.machine],
        "btf": _file_digest(btf_path),
        "cpus": _read_text("/sys/devices/system/cpu/possible"),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def _trusted(st: os.stat_result, what: str) -> None:
    if st.st_uid not in (0, os.geteuid()):
        raise CacheRefused(f"{what} belongs to uid {st.st_uid}, neither root nor us")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheRefused(f"{what} is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


class ProgramCache:
    """Images in one directory, by key."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, f"{_PREFIX}{key}{_SUFFIX}")

    def _check_directory(self) -> None:
        st = os.stat(self.directory)  # a symbolic link to it is fine (DynamicUser=)
        if not stat.S_ISDIR(st.st_mode):
            raise CacheRefused(f"{self.directory} is not a directory")
        _trusted(st, self.directory)

    def load(self, key: str) -> ProgramImage | None:
        """The image stored under ``key``; None if there is none or it is
        refused (logged, and a damaged one removed)."""
        path = self._path(key)
        try:
            self._check_directory()
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("program cache %s not used: %s", path, exc)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_IMAGE_BYTES:
                raise CacheRefused(f"not a regular file of at most {_MAX_IMAGE_BYTES} bytes")
            _trusted(st, path)
            with os.fdopen(fd, "rb", closefd=False) as f:
                data = f.read(_MAX_IMAGE_BYTES + 1)
            image = ProgramImage.from_json(json.loads(data))
            with contextlib.suppress(OSError):
                os.utime(fd)  # recently used: kept by _prune
            return image
        except CacheRefused as exc:
            log.warning("program cache %s not used: %s", path, exc)
            return None
        except (OSError, ValueError) as exc:  # ImageError and JSON errors included
            log.warning("program cache %s is damaged (%s); compiling anew", path, exc)
            self.discard(key)
            return None
        finally:
            os.close(fd)

    def discard(self, key: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._path(key))

    def store(self, key: str, image: ProgramImage) -> bool:
        """Write the image (atomically, mode 0600) and keep only the newest
        ``KEEP_IMAGES``; False (logged) if the directory is not usable."""
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            self._check_directory()
            fd, temporary = tempfile.mkstemp(prefix=".program-", dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(json.dumps(image.to_json()).encode())
                os.replace(temporary, self._path(key))
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
            self._prune()
        except OSError as exc:
            log.warning("cannot keep the compiled program in %s: %s", self.directory, exc)
            return False
        return True

    def _prune(self) -> None:
        entries = []
        with os.scandir(self.directory) as scan:
            for entry in scan:
                if entry.name.startswith(_PREFIX) and entry.name.endswith(_SUFFIX):
                    with contextlib.suppress(OSError):
                        entries.append((entry.stat(follow_symlinks=False).st_mtime_ns, entry.path))
        for _mtime, path in sorted(entries, reverse=True)[KEEP_IMAGES:]:
            with contextlib.suppress(OSError):
                os.unlink(path)
