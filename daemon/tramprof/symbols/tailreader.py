"""Incremental, capped reading of an append-only file that others control.

Runtimes only ever append to their perf map / jitdump, so a reader that
remembers the file's identity (device, inode) and how far it got can read
just the new bytes on every refresh.  It starts over when the path names a
different file, when the file shrank, or when the bytes just before the
remembered offset changed (the file was truncated and rewritten past our
offset between two refreshes, or a deleted file's inode number was reused).

The consumer decides how much of each chunk it used (a half-written line or
record stays unconsumed and is read again, completed, next time), so a
pending tail costs no memory between refreshes.

A file under a process's root (``/proc/PID/root``) no longer opens once the
process has exited, yet its samples are named at the next drain, after a
short-lived process is gone: so the reader keeps a descriptor of the last
file it opened, and reads the rest of that same file through it when the
root is gone. At most ``MAX_KEPT`` are kept by all readers together.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Final, Self

from tramprof.procfs.memory import descriptor_share
from tramprof.symbols.safeopen import (
    IO_ERROR,
    MISSING,
    REFUSAL_REASONS,
    STALE,
    FileIdentity,
    Refusal,
    SafeFile,
    open_untrusted,
)

#: Bytes before the resume offset compared on every refresh to detect rewrites.
ANCHOR_BYTES: Final = 32


#: Descriptors kept by all readers together (as many as the held
#: /proc/PID/mem files may take); beyond, a file is not kept.
MAX_KEPT: Final = descriptor_share()


class _Kept:
    """The descriptor one reader keeps (-1: none), and the count of all
    (a reader may be collected on any thread)."""

    total = 0
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.fd = -1
        self.identity: FileIdentity | None = None

    def keep(self, fd: int, identity: FileIdentity) -> None:
        if self.identity is not None and (self.identity.dev, self.identity.ino) == \
                (identity.dev, identity.ino):
            return
        self.close()
        with _Kept._lock:
            if _Kept.total >= MAX_KEPT:
                return
            try:
                self.fd = os.dup(fd)
            except OSError:
                return
            _Kept.total += 1
        self.identity = identity

    def reopen(self, max_bytes: int) -> SafeFile | None:
        """A fresh view of the kept file (its current length), or None."""
        if self.fd < 0:
            return None
        fd = -1
        try:
            fd = os.dup(self.fd)
            st = os.fstat(fd)
        except OSError:
            if fd >= 0:
                os.close(fd)
            return None
        return SafeFile(fd, FileIdentity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns),
                        max_bytes)

    def close(self) -> None:
        with _Kept._lock:
            if self.fd < 0:
                return
            fd, self.fd = self.fd, -1
            self.identity = None
            _Kept.total -= 1
        os.close(fd)


@dataclass
class SourceStats:
    """Counters every untrusted-file reader keeps (exported as metrics).

    ``bytes_read`` counts file content handed to the parser (a half-written
    tail that is read again counts again; the small rewrite check before the
    resume offset is not counted).  ``bytes_capped`` (bytes of the current
    file beyond the cap, never read) is a gauge, like the readers'
    ``entries``; everything else only grows.
    """

    bytes_read: int = 0
    bytes_capped: int = 0
    reloads: int = 0
    refused: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(REFUSAL_REASONS, 0)
    )

    def as_dict(self) -> dict[str, int]:
        """Flatten to ``name -> value``; refusals become ``refused_<reason>``
        (each drain sums these over every process's readers)."""
        out = {name: getattr(self, name) for name in _counter_names(type(self))}
        for reason, count in self.refused.items():
            out[f"refused_{reason}"] = count
        return out


_COUNTER_NAMES: dict[type[SourceStats], tuple[str, ...]] = {}


def _counter_names(cls: type[SourceStats]) -> tuple[str, ...]:
    """The integer fields of a ``SourceStats`` class, found once per class."""
    names = _COUNTER_NAMES.get(cls)
    if names is None:
        names = _COUNTER_NAMES[cls] = tuple(f.name for f in fields(cls)
                                            if f.type in ("int", int))
    return names


@dataclass(frozen=True, slots=True)
class RefreshResult:
    """What one ``refresh()`` did.

    ``refused`` is the refusal reason when the file could not be opened safely
    (previously loaded entries are kept).  ``reloaded`` means earlier entries
    were dropped because the path now names a new, shrunk or rewritten file.
    ``capped`` means the file is larger than the reader's byte cap.
    ``remaining`` is how many readable bytes are not consumed yet: a
    half-written last line or record, or what a read budget left for later.
    """

    refused: str | None = None
    reloaded: bool = False
    bytes_read: int = 0
    new_entries: int = 0
    capped: bool = False
    remaining: int = 0


def checked_pid(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"not a pid: {value!r}")
    return value


def process_tmp_file(pid: int, name: str, proc_root: str = "/proc") -> tuple[str, str]:
    """(path below the root, root) of ``/tmp/NAME`` as process ``pid`` sees it.

    Always below ``/proc/PID/root``: a containerised process writes into its
    own ``/tmp``, and the host's file of the same name belongs to another
    process. Opening ``path`` relative to ``root`` follows no symlink.
    """
    return f"tmp/{name}", f"{proc_root}/{checked_pid(pid)}/root"


class ProcessTmpFile:
    """Shared by the readers of a file a runtime writes into its own ``/tmp``
    (``FILE_NAME`` holds ``{}`` for the pid as the process knows it)."""

    FILE_NAME: ClassVar[str]
    _tail: TailReader

    if TYPE_CHECKING:  # the constructor every reader provides
        def __init__(self, path: str, expected_uid: int | None, *, root: str | None = None,
                     not_before_ns: int | None = None, **options: Any) -> None: ...

    @classmethod
    def for_process(cls, pid: int, nstgid_innermost: int, expected_uid: int | None, *,
                    proc_root: str = "/proc", not_before_ns: int | None = None,
                    **options: Any) -> Self:
        """Reader of the file of process ``pid`` (innermost NStgid ``nstgid_innermost``)."""
        path, root = process_tmp_file(
            pid, cls.FILE_NAME.format(checked_pid(nstgid_innermost)), proc_root)
        return cls(path, expected_uid, root=root, not_before_ns=not_before_ns, **options)

    @property
    def path(self) -> str:
        """The file this reader follows."""
        return self._tail.full_path

    def written(self) -> bool:
        """Whether the process has written the file (``TailReader.written``)."""
        return self._tail.written()


class TailReader:
    """Remembers (dev, inode, offset) of one path and hands out new bytes.

    Use::

        session = reader.open()          # Refusal | TailSession
        with session:
            if session.reset:
                drop_everything()
            for chunk in session.chunks(1 << 20):
                used = parse(chunk)      # bytes of whole lines / records
                session.commit(chunk, used)
    """

    def __init__(
        self,
        path: str,
        expected_uid: int | None,
        max_bytes: int,
        stats: SourceStats,
        *,
        root: str | None = None,
        not_before_ns: int | None = None,
        skip_stale_prefix: bool = False,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError("max_bytes must be positive")
        self.path = path
        #: Content last modified before this time (the process's start, in
        #: CLOCK_REALTIME ns) belongs to an earlier process with the same pid.
        self.not_before_ns = not_before_ns
        self._stale: FileIdentity | None = None
        #: The stale file's last bytes: a file that merely has its inode
        #: number (unlinked, then a new one made: ext4 hands the number out
        #: again at once) does not hold them at the same place.
        self._stale_tail = b""
        self._stale_tail_at = 0
        #: Append-only writers (perf maps) keep the stale lines at the start of
        #: the file; truncating writers (jitdump) start over and need no skip.
        self._skip_stale_prefix = skip_stale_prefix
        self.root = root
        self.expected_uid = expected_uid
        self.max_bytes = max_bytes
        self.stats = stats
        self.identity: FileIdentity | None = None
        #: Bytes of the current file consumed by the parser.
        self.offset = 0
        #: File length (capped) at the last refresh that read anything.
        self.seen_limit = 0
        self._anchor = b""
        self._kept = _Kept()
        weakref.finalize(self, self._kept.close)

    def open(self) -> TailSession | Refusal:
        """Open the path safely and work out where reading resumes."""
        opened = open_untrusted(self.path, self.expected_uid, self.max_bytes, root=self.root)
        if isinstance(opened, Refusal):
            kept = self._kept.reopen(self.max_bytes) if self._root_gone(opened) else None
            if kept is None:
                return self.refuse(opened)
            opened = kept
        if self.not_before_ns is not None and opened.identity.mtime_ns < self.not_before_ns:
            # Runtimes append to a file left by an earlier process with the
            # same pid (CPython never truncates): remember where that ends.
            self._stale = opened.identity
            self._stale_tail_at = max(0, opened.limit - ANCHOR_BYTES)
            try:
                self._stale_tail = opened.read_at(self._stale_tail_at, ANCHOR_BYTES)
            except OSError:
                self._stale_tail = b""
            opened.close()
            return self.refuse(Refusal(STALE, "last written before the process started"))
        try:
            reset = self._must_restart(opened)
            skipped = self._stale_prefix(opened) if reset else 0
        except OSError as err:
            opened.close()
            return self.refuse(Refusal(IO_ERROR, f"read: {err}"))
        reloaded = reset and self.identity is not None
        if reset:
            if reloaded:
                self.stats.reloads += 1
            self.offset = skipped
            self.seen_limit = 0
            self._anchor = b""
        self.identity = opened.identity
        self.stats.bytes_capped = opened.capped_bytes
        if self.root is not None:
            self._kept.keep(opened.fileno(), opened.identity)  # no-op for the file kept
        return TailSession(self, opened, reset, reloaded)

    def written(self) -> bool:
        """Whether the file is there, safe to open and written since the
        process started: opened and closed, nothing read or counted (a
        check of whether a reader would find anything, at a fraction of a
        read's cost)."""
        opened = open_untrusted(self.path, self.expected_uid, self.max_bytes, root=self.root)
        if isinstance(opened, Refusal):
            return False
        with opened:
            return self.not_before_ns is None or opened.identity.mtime_ns >= self.not_before_ns

    def _stale_prefix(self, f: SafeFile) -> int:
        """Bytes at the start of this file that an earlier process wrote: the
        stale file, appended to since (same inode, as long or longer, its
        last bytes still in place). A new file that got the stale one's
        inode number has none."""
        stale = self._stale
        if stale is None or not self._skip_stale_prefix:
            return 0
        identity = f.identity
        if (stale.dev, stale.ino) != (identity.dev, identity.ino) or identity.size < stale.size:
            return 0
        tail = self._stale_tail
        if tail and f.read_at(self._stale_tail_at, len(tail)) != tail:
            return 0
        return stale.size

    def _root_gone(self, refusal: Refusal) -> bool:
        """The process whose root the path is under has exited."""
        if self.root is None or refusal.reason != MISSING:
            return False
        try:
            os.stat(self.root)
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:
            return False
        return False

    @property
    def full_path(self) -> str:
        """The path as opened (``root``/``path`` when resolved below a root)."""
        return f"{self.root}/{self.path}" if self.root is not None else self.path

    def refuse(self, refusal: Refusal) -> Refusal:
        """Count ``refusal`` and return it."""
        refused = self.stats.refused
        refused[refusal.reason] = refused.get(refusal.reason, 0) + 1
        return refusal

    def _must_restart(self, f: SafeFile) -> bool:
        old = self.identity
        new = f.identity
        if old is None or (old.dev, old.ino) != (new.dev, new.ino):
            return True
        if new.size < self.offset:
            return True
        if self._anchor:
            start = self.offset - len(self._anchor)
            if f.read_at(start, len(self._anchor)) != self._anchor:
                return True
        return False

    def _advance(self, chunk: bytes | memoryview, used: int) -> None:
        if used <= 0:
            return
        self.offset += used
        tail = bytes(chunk[max(0, used - ANCHOR_BYTES) : used])
        if len(tail) < ANCHOR_BYTES:
            tail = (self._anchor + tail)[-ANCHOR_BYTES:]
        self._anchor = tail


class TailSession:
    """One refresh's view of the file: new bytes from the resume offset."""

    def __init__(self, reader: TailReader, f: SafeFile, reset: bool, reloaded: bool) -> None:
        self._reader = reader
        self._file = f
        #: True when the consumer must drop everything parsed earlier.
        self.reset = reset
        #: ``reset`` for a file that replaced one read before (not a first load).
        self.reloaded = reloaded
        self.read_bytes = 0
        #: Minimum length the consumer needs for its next chunk.
        self.want = 0
        self._drained = False

    @property
    def limit(self) -> int:
        """Readable length of the file (size capped at ``max_bytes``)."""
        return self._file.limit

    @property
    def capped(self) -> bool:
        return self._file.capped_bytes > 0

    @property
    def unchanged(self) -> bool:
        """Nothing was appended since the last refresh that read anything."""
        return not self.reset and self._file.limit == self._reader.seen_limit

    def read(self, length: int) -> bytes:
        """Read up to ``length`` bytes from the resume offset."""
        data = self._file.read_at(self._reader.offset, length)
        self.read_bytes += len(data)
        self._reader.stats.bytes_read += len(data)
        return data

    @property
    def remaining(self) -> int:
        """Readable bytes not consumed yet (includes a half-written tail)."""
        return max(0, self._file.limit - self._reader.offset)

    def chunks(self, chunk_bytes: int, budget: int | None = None) -> Iterator[bytes]:
        """Yield successive chunks from the resume offset to the readable end.

        After each chunk the consumer calls :meth:`commit`; the next chunk
        starts at the new offset, so an unconsumed tail is read again together
        with what follows it.  A consumer that needs a longer contiguous read
        (a record bigger than ``chunk_bytes``) sets :attr:`want` before
        committing nothing.  Iteration stops once every readable byte was
        offered (an unused tail is incomplete and waits for the next refresh),
        when a chunk makes no progress and a longer read would not help, or
        once ``budget`` bytes were read (the rest is left for later).
        """
        if self.unchanged:
            return
        reader = self._reader
        limit = self._file.limit
        self.want = 0
        while reader.offset < limit:
            if budget is not None and self.read_bytes >= budget:
                return
            before = reader.offset
            data = self.read(max(chunk_bytes, self.want))
            if not data:
                break
            self.want = 0
            yield data
            if before + len(data) >= limit:
                break  # all readable bytes were offered; an unused tail is incomplete
            if reader.offset == before and self.want <= len(data):
                break  # stalled, and a longer read would not help
        self._drained = True

    def commit(self, chunk: bytes | memoryview, used: int) -> None:
        """Mark the first ``used`` bytes of ``chunk`` (the last read) consumed."""
        self._reader._advance(chunk, used)

    def close(self) -> None:
        """Close the file; if all of it was seen, remember its length so an
        unchanged file is not read again."""
        if self._drained:
            self._reader.seen_limit = self._file.limit
        self._file.close()

    def __enter__(self) -> TailSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
