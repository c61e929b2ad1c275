"""Reading per-process facts from ``/proc`` without tripping over races.

Any process can exit between two reads, so every reader turns "the process is
no longer there" (ENOENT, ESRCH) into :class:`ProcessGone`, which callers
count instead of treating as an error. A process is identified by its pid
*and* its start time (:class:`ProcessIdentity`), because pids are reused.

Every function takes ``proc_root`` so tests can point it at a fixture tree and
a containerised daemon at the host's ``/proc``.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from tramprof.model import ProcessGone

__all__ = [
    "ExecSignature",
    "ProcStat",
    "ProcessGone",
    "ProcessIdentity",
    "StatusIds",
    "boottime_ns_to_ticks",
    "list_pids",
    "parse_stat",
    "read_cgroup",
    "read_cmdline",
    "read_comm",
    "read_exe",
    "read_identity",
    "read_proc_file",
    "read_start_ticks",
    "read_stat",
    "read_status_ids",
    "read_vdso_address",
]

_NSEC_PER_SEC = 1_000_000_000

# (start_code, end_code, start_stack): set by exec, randomised by ASLR.
ExecSignature = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process, unambiguously: pids are reused, (pid, start time) is not.

    ``start_ticks`` is field 22 of ``/proc/PID/stat``: clock ticks
    (``SC_CLK_TCK``) since boot. Two processes cannot hold the same pid within
    one tick, so the pair never names two processes.
    """

    pid: int
    start_ticks: int

    @classmethod
    def from_boottime(
        cls, pid: int, start_boottime_ns: int, clk_tck: int | None = None
    ) -> ProcessIdentity:
        """Identity of a BPF sample that carries ``task->start_boottime``."""
        return cls(pid, boottime_ns_to_ticks(start_boottime_ns, clk_tck))


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of ``/proc/PID/stat`` that lifecycle tracking (and the
    Python overhead budget: CPU time) need."""

    pid: int
    comm: str
    state: str
    ppid: int
    num_threads: int
    start_ticks: int
    start_code: int
    end_code: int
    start_stack: int
    cpu_ticks: int = 0     # utime + stime, all threads, in clock ticks
    vsize: int = 0         # bytes of address space: moves when a mapping is made or removed

    @property
    def exec_signature(self) -> ExecSignature | None:
        """Changes on every exec (with ASLR); None when the kernel hides it.

        The kernel shows the code and stack addresses only to readers allowed
        to ptrace the process (start/end_code read as 1, start_stack as 0
        otherwise) and has none for kernel threads and zombies.
        """
        if self.start_stack == 0 and self.start_code <= 1:
            return None
        return (self.start_code, self.end_code, self.start_stack)

    @property
    def leader_exited(self) -> bool:
        """The thread-group leader (the main thread) has exited; other
        threads may still run."""
        return self.state in ("Z", "X", "x")

    @property
    def is_dead(self) -> bool:
        """Exited but not yet reaped: its memory and mappings are gone.

        A zombie thread-group leader whose other threads still run is alive
        (``num_threads`` counts them), so it is not dead.
        """
        return self.leader_exited and self.num_threads <= 1


def boottime_ns_to_ticks(ns: int, clk_tck: int | None = None) -> int:
    """Convert ``task->start_boottime`` (ns) to the ticks ``/proc`` shows.

    Mirrors the kernel's ``nsec_to_clock_t`` branch for branch, so a BPF
    sample and a ``/proc`` read give exactly the same number. Assumes the
    reader of ``/proc`` is in the initial time namespace (a time namespace
    shifts the boottime that ``/proc/PID/stat`` reports).
    """
    hz = clk_tck if clk_tck is not None else os.sysconf("SC_CLK_TCK")
    if hz <= 0:
        raise ValueError(f"invalid clock tick rate {hz}")
    if _NSEC_PER_SEC % hz == 0:
        return ns // (_NSEC_PER_SEC // hz)
    if hz % 512 == 0:
        return ns * (hz // 512) // (_NSEC_PER_SEC // 512)
    return ns * 9 // ((9 * _NSEC_PER_SEC + hz // 2) // hz)


def read_proc_file(pid: int, name: str, proc_root: str = "/proc",
                   limit: int | None = None) -> bytes:
    """The bytes of ``{proc_root}/{pid}/{name}``, at most ``limit`` of them
    (all when None). Raises ProcessGone when the process is gone.

    Plain descriptor reads of ``_READ_CHUNK``, no file object: the daemon reads
    thousands of these files a minute on a busy node (a third faster than
    ``open``), and a buffered ``read(limit)`` of a large limit allocates the
    whole limit first (a 16 MiB bound made a 4 KiB maps read twice as slow).
    """
    try:
        fd = os.open(f"{proc_root}/{pid}/{name}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            left = _UNLIMITED if limit is None else limit
            while left > 0 and (chunk := os.read(fd, min(_READ_CHUNK, left))):
                chunks.append(chunk)
                left -= len(chunk)
        finally:
            os.close(fd)
    except (FileNotFoundError, ProcessLookupError) as e:
        raise ProcessGone(pid, f"cannot read {name}: {e.strerror or e}") from e
    return b"".join(chunks)


_READ_CHUNK = 1 << 16
_UNLIMITED = 1 << 62


def parse_stat(pid: int, data: bytes) -> ProcStat:
    """Parse the text of ``/proc/PID/stat``.

    comm is the text between the first ``(`` and the *last* ``)``: it may
    contain spaces and parentheses itself, so splitting on spaces is wrong.
    Raises ValueError when the text is not a stat line.
    """
    lparen = data.find(b"(")
    rparen = data.rfind(b")")
    if lparen < 0 or rparen < lparen:
        raise ValueError(f"pid {pid}: malformed stat line {data[:64]!r}")
    rest = data[rparen + 1 :].split()
    # rest[0] is field 3 (state); field N is rest[N - 3].
    if len(rest) < 20:
        raise ValueError(f"pid {pid}: stat line has {len(rest) + 2} fields, need 22")

    def field(n: int) -> int:
        return int(rest[n - 3]) if len(rest) > n - 3 else 0

    return ProcStat(
        pid=pid,
        comm=data[lparen + 1 : rparen].decode("utf-8", "replace"),
        state=rest[0].decode("ascii", "replace"),
        ppid=field(4),
        num_threads=field(20),
        start_ticks=field(22),
        start_code=field(26),
        end_code=field(27),
        start_stack=field(28),
        cpu_ticks=field(14) + field(15),
        vsize=field(23),
    )


def read_stat(pid: int, proc_root: str = "/proc") -> ProcStat:
    """Read and parse ``/proc/PID/stat`` (one read: a consistent snapshot)."""
    data = read_proc_file(pid, "stat", proc_root)
    if not data:
        # The task was reaped between open() and read().
        raise ProcessGone(pid, "stat is empty")
    return parse_stat(pid, data)


def read_start_ticks(pid: int, proc_root: str = "/proc") -> int:
    """Field 22 of ``/proc/PID/stat``: start time in clock ticks since boot."""
    return read_stat(pid, proc_root).start_ticks


def read_identity(pid: int, proc_root: str = "/proc") -> ProcessIdentity:
    """The identity of whichever process holds ``pid`` right now."""
    return ProcessIdentity(pid, read_start_ticks(pid, proc_root))


def read_comm(pid: int, proc_root: str = "/proc") -> str:
    """The thread-group leader's name (at most 15 bytes, any bytes but NUL).

    Only the trailing newline the kernel appends is removed: a name may
    itself end in whitespace. Undecodable bytes become U+FFFD, because the
    name ends up in metric labels, which must be valid UTF-8.
    """
    data = read_proc_file(pid, "comm", proc_root)
    if data.endswith(b"\n"):
        data = data[:-1]
    return data.decode("utf-8", "replace")


def read_exe(pid: int, proc_root: str = "/proc") -> str | None:
    """Path of the main executable, or None when it cannot be read.

    None covers kernel threads and zombies (no mm), and processes we may not
    ptrace. The path keeps the kernel's `` (deleted)`` suffix and is
    surrogate-escaped like every ``os`` path, so it can be opened again.
    Raises ProcessGone only when the process itself is gone.
    """
    try:
        return os.readlink(f"{proc_root}/{pid}/exe")
    except ProcessLookupError as e:
        raise ProcessGone(pid, "exited while its exe was read") from e
    except FileNotFoundError as e:
        # ENOENT means either "no such pid" or "pid without an executable".
        if not os.path.exists(f"{proc_root}/{pid}"):
            raise ProcessGone(pid, "cannot read exe") from e
        return None
    except OSError:
        return None


def read_cmdline(pid: int, proc_root: str = "/proc") -> list[str]:
    """The argument vector; empty for kernel threads and zombies.

    A process that rewrote its arguments (setproctitle) may yield one
    space-separated string; that is what it asked to show.
    """
    data = read_proc_file(pid, "cmdline", proc_root)
    if not data:
        return []
    if data.endswith(b"\0"):
        data = data[:-1]
    return [arg.decode("utf-8", "replace") for arg in data.split(b"\0")]


def read_cgroup(pid: int, proc_root: str = "/proc") -> str:
    """The process's cgroup, as a string suitable for grouping and labels.

    On a pure cgroup v2 host that is the path of the ``0::`` line. When v1
    hierarchies are present (v1 or hybrid; the controllers live there) it is
    the v1 path when every hierarchy agrees, else ``controllers:path`` pairs
    joined with ``;`` in file order.
    """
    text = read_proc_file(pid, "cgroup", proc_root).decode("utf-8", "replace")
    unified: str | None = None
    v1: list[tuple[str, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            unified = path
        else:
            v1.append((controllers, path))
    if not v1:
        return unified if unified is not None else ""
    paths = {path for _, path in v1}
    if len(paths) == 1:
        return paths.pop()
    return ";".join(f"{controllers}:{path}" for controllers, path in v1)


@dataclass(frozen=True, slots=True)
class StatusIds:
    """Who a process is, from one read of ``/proc/PID/status``: its pid in
    each nested pid namespace (outermost first, the last as the process sees
    itself) and its effective uid and gid (the owner its files must have)."""

    nstgid: tuple[int, ...]
    euid: int
    egid: int

    @property
    def inner_pid(self) -> int:
        """The pid as the process itself sees it (names its /tmp files)."""
        return self.nstgid[-1]


def read_status_ids(pid: int, proc_root: str = "/proc") -> StatusIds:
    """Namespace pids and effective ids in one read (a new process needs all).

    Kernels without the ``NStgid`` line (< 4.1) give ``(Tgid,)``.
    """
    nstgid = tgid = None
    euid = egid = None
    for line in read_proc_file(pid, "status", proc_root).splitlines():
        if line.startswith(b"NStgid:"):
            nstgid = tuple(int(x) for x in line[len(b"NStgid:") :].split())
        elif line.startswith(b"Tgid:"):
            tgid = (int(line[len(b"Tgid:") :]),)
        elif line.startswith(b"Uid:"):
            euid = int(line.split()[2])
        elif line.startswith(b"Gid:"):
            egid = int(line.split()[2])
    nstgid = nstgid or tgid
    if not nstgid or euid is None or egid is None:
        raise ValueError(f"{proc_root}/{pid}/status lacks NStgid/Tgid, Uid or Gid")
    return StatusIds(nstgid, euid, egid)


_AT_SYSINFO_EHDR = 33
_AUXV_ENTRY = struct.Struct("=QQ")


def read_vdso_address(pid: int, proc_root: str = "/proc") -> int | None:
    """Where the kernel put the process's vdso (``AT_SYSINFO_EHDR`` of its
    auxiliary vector), None if it has none. Unlike a ``[vdso]`` line of the
    maps, this is the kernel's word alone."""
    data = read_proc_file(pid, "auxv", proc_root)
    for key, value in _AUXV_ENTRY.iter_unpack(data[:len(data) // 16 * 16]):
        if key == _AT_SYSINFO_EHDR:
            return int(value)
        if key == 0:  # AT_NULL
            break
    return None


def list_pids(proc_root: str = "/proc") -> list[int]:
    """Pids of all processes (thread-group leaders) visible in ``proc_root``."""
    pids = []
    with os.scandir(proc_root) as it:
        for entry in it:
            name = entry.name
            if name.isascii() and name.isdigit():
                pids.append(int(name))
    pids.sort()
    return pids
